"""A handoff of another model is refused by every transport before its pages move:
the decode loop on the numpy `FakeRunner` (whose shard is a real device) takes
handoffs from a real `DevicePutConnector`, `TransferServerReceiver` and
`GrpcReceiver`; the forged one names another model's fingerprint, every shape right.
Refused means: no pull and no body read, nothing placed or installed in a slot,
`handoffs_model_mismatch` counted, the request prefilled again here, no page held."""
from __future__ import annotations

import time

import jax
import grpc
import pytest

from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.transfer import grpc_stream, jax_compat
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.device_put import DevicePutConnector
from jaxpd.transfer.wire import TransferError
from tests.fake_runner import FakeRunner, InlineExecutor, pages
from tests.support.decode_env import LAYERS, PAGE_SIZE, assert_no_page_held, make, run

FP_HERE, FP_OTHER = "1" * 64, "2" * 64


class _DeviceRunner(FakeRunner):
    """`FakeRunner` whose shards are a real device, as `place` needs."""

    def shard_sharding(self, shard: int):
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _handoff(r: Request, fingerprint: str, first: int, value: float) -> KVHandoff:
    kv = jax.device_put(pages(LAYERS, -(-r.num_tokens // PAGE_SIZE), value, PAGE_SIZE))
    return KVHandoff(r.request_id, r.num_tokens, first, kv, -kv, payload=r.to_wire(),
                     fingerprint=fingerprint)


def _mirror(env, rid: str, prompt_len: int = 5) -> Request:
    """A request registered on the decode side before its KV comes (the router's Decode)."""
    r = Request.from_wire(Request(rid, list(range(1, prompt_len + 1)),
                                  SamplingParams(max_tokens=3)).to_wire())
    env.requests.register(r)
    return r


def _transport(kind: str):
    """(receiver, sender) of a real transport, as two processes' engines hold them."""
    if kind == "device_put":
        pipe = DevicePutConnector(stage=False)
        return pipe, pipe
    if kind == "grpc":
        receiver = grpc_stream.GrpcReceiver()
        return receiver, grpc_stream.GrpcSender(decode_address=receiver.address)
    from jaxpd.transfer.transfer_server import (TransferServerOptions, TransferServerReceiver,
                                                TransferServerSender)
    options = TransferServerOptions(pull_timeout_s=5.0, rpc_timeout_s=5.0)
    receiver = TransferServerReceiver(options=options)
    return receiver, TransferServerSender(decode_control_address=receiver.control_address,
                                          options=options)


@pytest.mark.parametrize("kind", [
    "device_put", "grpc",
    pytest.param("transfer_server", marks=pytest.mark.skipif(
        jax_compat.unavailable_reason() is not None,
        reason=str(jax_compat.unavailable_reason())))])
def test_every_transport_refuses_another_models_handoff_before_its_pages_move(kind):
    receiver, sender = _transport(kind)
    placed = []
    place = receiver.place
    receiver.place = lambda h, sharding: placed.append(h.request_id) or place(h, sharding)
    expect_model = getattr(receiver, "expect_model", None)
    if expect_model is not None:
        expect_model(FP_HERE)              # as a decode-only engine does
    try:
        env = make(InlineExecutor(), remote=True, receiver=receiver, fingerprint=FP_HERE,
                   runner=_DeviceRunner(1, 2, 17, PAGE_SIZE, LAYERS))
        r = _mirror(env, "other-model", prompt_len=9)
        sender.send(_handoff(r, FP_OTHER, first=61, value=1.0))
        run(env, lambda: r.state is State.WAITING)          # prefilled again, here
        assert env.requests.prefill_inbox.get_nowait() is r and r.output_ids == []
        assert placed == [] and env.runner.inserts == []     # nothing moved, no slot
        counts = env.stats.snapshot()
        assert counts["handoffs_model_mismatch"] == 1 and counts["handoffs_rejected"] == 1
        assert counts["transfer_failures"] == 1
        assert_no_page_held(env)
        if kind == "transfer_server":       # the Offer was never pulled: taken back
            deadline = time.monotonic() + 10      # (on the sender's reclaim thread)
            while (sender.pending() or not sender.reclaimed) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sender.pending() == 0 and sender.reclaimed == 1
        # The same request's KV from this model is taken, placed and decoded.
        r.transition(State.PREFILLING)
        r.append_token(61, time.perf_counter())
        r.transition(State.TRANSFERRING)
        sender.send(_handoff(r, FP_HERE, first=62, value=2.0))
        run(env, lambda: r.is_final)
        assert placed == [r.request_id] and r.output_ids == [61, 62, 63]
        assert env.stats.snapshot()["handoffs_model_mismatch"] == 1
        assert_no_page_held(env)
    finally:
        if sender is not receiver:
            sender.close()
        receiver.close()


def test_grpc_stream_of_another_model_is_answered_before_its_body_is_read():
    """The stream header is checked before any body message is read: a sender that
    names another model and then streams without end gets its answer at once, and
    what is queued carries no bytes."""
    receiver = grpc_stream.GrpcReceiver()
    receiver.expect_model(FP_HERE)
    sent = []
    kv = pages(LAYERS, 1, 1.0, PAGE_SIZE)
    header = grpc_stream.encode_handoff(KVHandoff("r", 3, 5, kv, kv,
                                                  fingerprint=FP_OTHER)).header

    def endless():
        yield header
        while True:
            sent.append(1)
            yield b"\0" * 4096

    channel = grpc.insecure_channel(receiver.address)
    try:
        call = channel.stream_unary(grpc_stream.SEND_METHOD)
        call(endless(), timeout=30)                    # OK: the decode side owns it now
        h = receiver.receive(timeout=5)
        assert h.request_id == "r" and h.fingerprint == FP_OTHER and "not read" in h.refused
        assert isinstance(h.k, jax.ShapeDtypeStruct) and h.k.shape == kv.shape
        with pytest.raises(TransferError, match="not read"):
            receiver.place(h, None)
        assert receiver.counts()["kv_streams_rejected"] == 0
        # A stream of this model is read whole, as before.
        good = grpc_stream.encode_handoff(KVHandoff("s", 3, 5, kv, kv, fingerprint=FP_HERE))
        call(good.messages(), timeout=30)
        h = receiver.receive(timeout=5)
        assert h.refused == "" and (h.k == kv).all()
    finally:
        channel.close()
        receiver.close()


def test_a_decode_only_engine_tells_its_stream_receiver_its_model():
    from jaxpd.llm import LLM
    receiver = grpc_stream.GrpcReceiver()
    with LLM(None, mesh="decode=1", max_model_len=64, connector=receiver, warmup=False) as llm:
        assert receiver.fingerprint == llm.fingerprint and len(llm.fingerprint) == 64
