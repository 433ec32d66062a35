"""Peer input is untrusted: forged handoffs, requests and control messages
fail that request or that call with a reason, never an engine loop, never a hang, and
leave no page behind.

The decode loop runs on the numpy `FakeRunner` (remote handoffs resolve to mirrors
registered first, as the router's `Decode` does); the control plane and the KV stream
are the real gRPC servers on 127.0.0.1; the checksum test moves real pages through two
JAX transfer servers in this process.
"""
from __future__ import annotations

import dataclasses
import time
import tracemalloc

import grpc
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

from jaxpd.engine.loops.prefill_loop import PrefillLoop
from jaxpd.engine.scheduling.scheduler import PrefillScheduler
from jaxpd.request import Request, State, logprobs_from_wire
from jaxpd.sampling_params import SamplingParams
from jaxpd.transfer import grpc_stream, jax_compat
from jaxpd.transfer.checksum import ChecksumMismatchError, page_checksums
from jaxpd.transfer.connector import KVHandoff, KVPart
from jaxpd.transfer.control import OFFER_METHOD, ControlServer, Offer
from jaxpd.transfer.layout import describe
from jaxpd.transfer.wire import (MAX_MESSAGE_BYTES, WIRE_VERSION, MalformedMessage,
                                 WireVersionError, pack, unpack_checked)
from tests.fake_runner import FakeRunner, InlineExecutor, pages
from tests.support.decode_env import (LAYERS, MAX_MODEL_LEN, PAGE_SIZE, assert_no_page_held,
                                      make, run)


@pytest.fixture
def pool():
    return InlineExecutor()


def mirror(env, rid: str, prompt_len: int = 5, max_tokens: int = 3) -> Request:
    """A request registered on the decode side before its KV comes (the router's Decode)."""
    wire = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)
                   ).to_wire()
    r = Request.from_wire(wire)
    env.requests.register(r)
    return r


def remote(r: Request, num_tokens: int | None = None, first: int = 61,
           num_pages: int | None = None, value: float = 1.0, dtype=np.float32,
           part: KVPart | None = None, layers: int = LAYERS) -> KVHandoff:
    """A handoff as another process's connector delivers it (payload: the wire form)."""
    n = r.num_tokens if num_tokens is None else num_tokens
    p = -(-n // PAGE_SIZE) if num_pages is None else num_pages
    kv = pages(layers, p, value, PAGE_SIZE).astype(dtype)
    return KVHandoff(r.request_id, n, first, kv, -kv, payload=r.to_wire(), part=part)


def counts(env) -> dict:
    return env.stats.snapshot()


def assert_refused_before_placing(env, h: KVHandoff) -> None:
    assert any(x is h for x in env.receiver.discarded)
    assert not any(x is h for x in env.receiver.placed)     # no device op for it
    assert env.runner.inserts == []


def assert_a_good_request_still_finishes(env) -> None:
    good = mirror(env, "good", prompt_len=6, max_tokens=3)
    env.receiver.push(remote(good, first=40))
    run(env, lambda: good.is_final)
    assert good.output_ids == [40, 41, 42] and good.finish_reason == "length"


# ---- forged handoffs at the decode loop --------------------------------------------

FP_HERE, FP_OTHER = "1" * 64, "2" * 64


@pytest.mark.parametrize("fingerprint", [FP_OTHER, "", "1" * 63, None, 5])
def test_forged_handoff_of_another_model_is_refused_before_any_pull(pool, fingerprint):
    """KV with every shape right but another model's fingerprint (or none): refused
    before a slot, a page or a pull, counted, and the request prefilled again here --
    never decoded from that KV."""
    env = make(pool, remote=True, fingerprint=FP_HERE)
    r = mirror(env, "other-model", prompt_len=9)
    h = dataclasses.replace(remote(r), fingerprint=fingerprint)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)          # prefilled again, here
    assert env.requests.prefill_inbox.get_nowait() is r and r.output_ids == []
    assert_refused_before_placing(env, h)
    assert counts(env)["handoffs_model_mismatch"] == 1
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["transfer_failures"] == 1
    assert all(s is None for s in env.scheduler.slots)  # nothing installed in a slot
    assert_no_page_held(env)
    good = mirror(env, "same-model", prompt_len=6, max_tokens=3)
    env.receiver.push(dataclasses.replace(remote(good, first=40), fingerprint=FP_HERE))
    run(env, lambda: good.is_final)
    assert good.output_ids == [40, 41, 42] and counts(env)["handoffs_model_mismatch"] == 1
    assert_no_page_held(env)


def test_offer_and_stream_header_carry_the_fingerprint():
    offer = dataclasses.replace(good_offer(), fingerprint=FP_HERE)
    assert Offer.from_dict(unpack_checked(pack(offer.to_dict()), "Offer")) == offer
    assert Offer.from_dict(good_offer().to_dict()).fingerprint == ""
    kv = pages(LAYERS, 1, 1.0, PAGE_SIZE)
    encoded = grpc_stream.encode_handoff(KVHandoff("r", 3, 5, kv, kv, fingerprint=FP_HERE))
    assert grpc_stream.decode_handoff(encoded.messages()).fingerprint == FP_HERE
    forged = pack({**unpack_checked(encoded.header, "header"), "fingerprint": "zz"})
    with pytest.raises(grpc_stream.MalformedHeaderError, match="fingerprint"):
        grpc_stream.decode_handoff([forged, *list(encoded.messages())[1:]])

@pytest.mark.parametrize("num_tokens,num_pages", [(3, 4), (9, 1), (9, 0)])
def test_forged_handoff_more_pages_than_tokens_is_refused_and_engine_lives(pool, num_tokens,
                                                                           num_pages):
    # Finding 2: 4 pages announced for num_tokens=3 crashed the decode thread (the
    # pages were checked against the sender's own count, not what was allocated).
    env = make(pool, remote=True)
    r = mirror(env, "forged", prompt_len=num_tokens)
    h = remote(r, num_pages=num_pages)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)          # prefilled again, here
    assert env.requests.prefill_inbox.get_nowait() is r
    assert_refused_before_placing(env, h)
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["transfer_failures"] == 1
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


@pytest.mark.parametrize("first_page,num_pages", [(-1, 2), (True, 1), ("1", 1), (2, 0),
                                                  (1, 3), (3, 1)])
def test_forged_first_page_is_refused_and_engine_lives(pool, first_page, num_pages):
    """A handoff's `first_page` (leading pages it leaves out, prefix caching) must be
    an int naming a full page below the last, and its pages the rest exactly."""
    import dataclasses
    env = make(pool, remote=True)
    r = mirror(env, "skipper", prompt_len=2 * PAGE_SIZE + 1)       # 3 pages, 2 full
    h = dataclasses.replace(remote(r, num_pages=num_pages), first_page=first_page)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)
    assert_refused_before_placing(env, h)
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["prefix_skip_misses"] == 0
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


def test_handoff_leaving_out_pages_this_side_does_not_hold_is_prefilled_again(pool):
    """A well-formed handoff that leaves out 2 pages (the sender believed them cached
    here) to a pool that holds none: refused before any slot, page or device op, its
    request prefilled again, and never decoded from pages that are not there."""
    import dataclasses
    env = make(pool, remote=True)
    r = mirror(env, "stale", prompt_len=2 * PAGE_SIZE + 1)
    h = dataclasses.replace(remote(r, num_pages=1), first_page=2)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)
    assert env.requests.prefill_inbox.get_nowait() is r and r.kv_skip_missed
    assert not any(x is h for x in env.receiver.placed) and env.runner.inserts == []
    assert counts(env)["prefix_skip_misses"] == 1 and counts(env)["handoffs_rejected"] == 0
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


def test_forged_handoff_that_never_fits_is_aborted_and_queue_moves_on(pool):
    # Finding 3: num_tokens=100000 sat at the head of the admission queue for good and
    # every request behind it hung.
    env = make(pool, slots=1, remote=True)
    huge = mirror(env, "huge")
    h = remote(huge, num_tokens=100_000)                 # pages consistent with its count
    env.receiver.push(h)
    behind = mirror(env, "behind", prompt_len=4)
    env.receiver.push(remote(behind, first=7))
    run(env, lambda: behind.is_final)
    assert behind.output_ids == [7, 8, 9]
    assert huge.state is State.ABORTED
    assert "never fit" in huge.abort_reason and f"max_model_len={MAX_MODEL_LEN}" in huge.abort_reason
    assert any(x is h for x in env.receiver.discarded)
    assert not any(x is h for x in env.receiver.placed)
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["aborted"] == 1
    assert_no_page_held(env)


@pytest.mark.parametrize("first", [1000, -1, 2**40])
def test_forged_first_token_outside_vocab_is_refused(pool, first):
    # 2**40 used to overflow the loop's int32 token array and kill the thread; 1000
    # (vocab 1000) decoded silently into an out-of-vocabulary stream.
    env = make(pool, remote=True)
    r = mirror(env, "vocab")
    h = remote(r, first=first)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)
    assert r.output_ids == []                            # the forged token was never taken
    assert_refused_before_placing(env, h)
    assert counts(env)["handoffs_rejected"] == 1
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


def test_forged_handoff_for_an_unregistered_request_is_discarded(pool):
    # A decode-only process used to invent a request from any peer's wire form and
    # decode it; a remote handoff is now taken only for a registered mirror.
    env = make(pool, remote=True)
    ghost = Request("ghost", [1, 2, 3], SamplingParams(max_tokens=3))
    h = remote(ghost)
    env.receiver.push(h)
    assert_a_good_request_still_finishes(env)
    assert env.requests.get("ghost") is None
    assert any(x is h for x in env.receiver.discarded)
    assert not any(x is h for x in env.receiver.placed)
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["transfers"] == 1
    assert_no_page_held(env)


def test_forged_handoff_naming_another_request_in_its_payload_is_refused(pool):
    env = make(pool, remote=True)
    victim, other = mirror(env, "victim"), mirror(env, "other")
    h = remote(victim)
    h.payload = other.to_wire()
    env.receiver.push(h)
    run(env, lambda: not env.receiver.queue and env.loop.idle)
    assert any(x is h for x in env.receiver.discarded) and env.runner.inserts == []
    assert victim.state is State.TRANSFERRING and victim.output_ids == []
    assert counts(env)["handoffs_rejected"] == 1
    assert_no_page_held(env)


@pytest.mark.parametrize("change", ["dtype", "page_shape", "layers", "k_differs_from_v"])
def test_forged_handoff_of_the_wrong_shape_or_dtype_is_refused_before_placing(pool, change):
    env = make(pool, remote=True)
    r = mirror(env, "misfit")
    h = remote(r, dtype=np.float16 if change == "dtype" else np.float32,
               layers=LAYERS + 1 if change == "layers" else LAYERS)
    if change == "page_shape":
        h.k = h.v = np.zeros((LAYERS, 2, PAGE_SIZE * 2, 1, 1), np.float32)
    if change == "k_differs_from_v":
        h.v = h.v[:, :1]
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)
    assert_refused_before_placing(env, h)
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


def test_forged_handoff_covering_another_token_count_than_its_request_is_refused(pool, caplog):
    # Pages consistent with the handoff's own count, but not the request's: decoding
    # from them would continue another sequence.
    env = make(pool, remote=True)
    r = mirror(env, "miscounted", prompt_len=5)
    h = remote(r, num_tokens=9)
    env.receiver.push(h)
    run(env, lambda: r.state is State.WAITING)
    assert_refused_before_placing(env, h)
    assert "covers 9 tokens, the request holds 5" in caplog.text
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["transfer_failures"] == 1
    assert_no_page_held(env)


def test_forged_layerwise_part_fails_its_transfer_and_frees_the_slot(pool):
    env = make(pool, remote=True)
    r = mirror(env, "parts", prompt_len=6)
    env.receiver.push(remote(r, first=-1, part=KVPart(1, 0, 2, 0), layers=1))
    run(env, lambda: env.scheduler.slot_of(r) is not None)
    bad = remote(r, num_tokens=7, first=9, part=KVPart(1, 1, 2, 1), layers=1)
    env.receiver.push(bad)
    run(env, lambda: r.state is State.WAITING)
    assert any(x is bad for x in env.receiver.discarded) and env.runner.inserts == []
    assert r.output_ids == []
    assert counts(env)["transfer_failures"] == 1
    assert_no_page_held(env)


def mirror_asking_logprobs(env, rid: str) -> Request:
    r = Request.from_wire(Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, logprobs=2)
                                  ).to_wire())
    env.requests.register(r)
    return r


def test_first_token_logprobs_come_in_the_handoffs_wire_form(pool):
    env = make(pool, remote=True)
    r = mirror_asking_logprobs(env, "asks")
    sent = Request.from_wire(r.to_wire(), State.PREFILLING)   # the prefill worker's copy
    first = (-0.5, ((61, -0.5), (3, -2.0)))
    sent.append_token(61, time.perf_counter(), first)
    env.receiver.push(dataclasses.replace(remote(r), payload=sent.to_wire(r.num_tokens)))
    run(env, lambda: r.is_final)
    assert r.output_ids == [61, 62, 63] and r.logprobs[0] == first
    assert len(r.logprobs) == 3            # (the fake runner computes none: placeholders)
    assert_no_page_held(env)


@pytest.mark.parametrize("forged", [None, "junk", [float("inf"), []], [-0.5, [["61", -0.5]]],
                                    [-0.5, [[61, -0.5], [1, -1.0], [2, -2.0]]], [0, []]])
def test_forged_first_token_logprobs_fail_the_transfer_and_it_is_prefilled_again(pool, forged):
    env = make(pool, remote=True)
    r = mirror_asking_logprobs(env, "forged-logprobs")
    env.receiver.push(dataclasses.replace(remote(r), payload={**r.to_wire(),
                                                              "next_logprobs": forged}))
    run(env, lambda: r.state is State.WAITING)
    assert env.requests.prefill_inbox.get_nowait() is r and r.output_ids == []
    assert counts(env)["handoffs_rejected"] == 1 and counts(env)["transfer_failures"] == 1
    assert_a_good_request_still_finishes(env)
    assert_no_page_held(env)


# ---- forged requests: limits are checked where they come in ----------------------

def test_forged_request_beyond_limits_is_refused_by_the_peer_check(pool):
    # Finding 4: a 300-token prompt against max_model_len=32 reached the scheduler.
    env = make(pool, remote=True)
    forged = lambda r: Request.from_wire(r.to_wire())
    cases = [(forged(Request("long", list(range(300)), SamplingParams(max_tokens=2))),
              "max_prompt_len"),
             (forged(Request("oov", [1, 5000], SamplingParams(max_tokens=2))),
              "outside the vocabulary"),
             (Request("bad\x1b[2J", [1, 2], SamplingParams(max_tokens=2)), "request_id"),
             (Request("too-many", [1, 2], SamplingParams(max_tokens=40)), "max_model_len")]
    for request, field in cases:
        with pytest.raises(ValueError, match=field):
            env.requests.check(request)
    twice = mirror(env, "twice")
    with pytest.raises(ValueError, match="already in flight"):
        env.requests.register(Request.from_wire(twice.to_wire()))
    assert len(env.requests) == 1                        # only the first mirror


@pytest.mark.parametrize("field,value", [("seed", "x"), ("prompt_ids", [1, "2"]),
                                         ("params", {"max_tokens": 0}), ("stop_ids", None),
                                         ("request_id", 7), ("kv_skip_pages", -1),
                                         ("kv_skip_pages", "1"), ("kv_skip_pages", True),
                                         ("kv_skip_pages", 2)])
def test_forged_wire_form_names_the_field(field, value):
    wire = Request("w", [1, 2], SamplingParams(max_tokens=2)).to_wire()
    with pytest.raises(ValueError, match=field.split("_")[0]):
        Request.from_wire({**wire, field: value})


@pytest.mark.parametrize("logprobs,word", [
    (None, "a list of 1"), ([], "a list of 1"),
    ([[float("inf"), []]], "finite"), ([["x", []]], "finite"), ([[0, []]], "finite"),
    ([[-0.5, [[True, -0.5]]]], "token id"), ([[-0.5, [[-1, -0.5]]]], "token id"),
    ([[-0.5, [[2**40, -0.5]]]], "token id"), ([[-0.5, [[5, -0.5, 0]]]], "token id"),
    ([[-0.5, [[5, -0.5]] * 3]], "more than the 2"), ([[-0.5]], r"\[0\] must be")])
def test_forged_logprobs_from_a_peer_name_the_field(logprobs, word):
    with pytest.raises(ValueError, match=r"logprobs.*" + word):
        logprobs_from_wire(logprobs, 1, 2)


def test_forged_request_past_the_checks_aborts_alone_and_the_prefill_loop_lives(pool):
    # Defence in depth: one that reaches a prefill inbox anyway (not through `submit`)
    # used to raise inside the scheduler and kill the engine thread.
    env = make(pool)
    loop = PrefillLoop(None, PrefillScheduler([16, 32], 4, 64), None, env.requests,
                       env.requests.prefill_inbox, PAGE_SIZE, env.stats)
    long = Request("long", list(range(1, 101)), SamplingParams(max_tokens=2))
    fine = Request("fine", [1, 2, 3], SamplingParams(max_tokens=2))
    for r in (long, fine):
        env.requests.prefill_inbox.put(r)
    loop.take_queued()
    assert long.state is State.ABORTED and "largest prefill bucket" in long.abort_reason
    assert fine.state is State.WAITING and len(loop.scheduler) == 1
    assert counts(env)["aborted"] == 1


# ---- forged control messages -------------------------------------------------------

@pytest.fixture
def control():
    offers = []
    server = ControlServer("127.0.0.1:0", on_offer=lambda o, left, peer: offers.append(o))
    channel = grpc.insecure_channel(server.address)
    yield channel.unary_unary(OFFER_METHOD), offers      # raw bytes both ways
    channel.close()
    server.stop()


def call_status(call, body: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(body, timeout=10)
    return info.value


def good_offer() -> Offer:
    layout = describe(jnp.zeros((LAYERS, 1, PAGE_SIZE, 1, 2)))
    return Offer(uuid=1, request_id="r", num_tokens=3, first_token=5, k=layout, v=layout,
                 transfer_address="127.0.0.1:1", ack_address="127.0.0.1:1")


def test_forged_control_message_oversized_is_refused_cheaply(control):
    # Finding 9: a 4 MB msgpack control message cost 280 MB and 2.6 s to decode.
    call, offers = control
    body = pack({"wire_version": WIRE_VERSION, "junk": [[]] * (2 * MAX_MESSAGE_BYTES)})
    assert len(body) > 2 * MAX_MESSAGE_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(MalformedMessage, match="more than"):
            unpack_checked(body, "Offer")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10                               # refused before decoding a byte
    error = call_status(call, body)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED      # gRPC's own cap
    # Under the byte limit but past a container limit: refused by msgpack's bounds.
    wide = msgpack.packb({"wire_version": WIRE_VERSION, "ids": [1] * 600_000})
    assert len(wide) < MAX_MESSAGE_BYTES
    error = call_status(call, wide)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in error.details()
    assert offers == []


def test_forged_control_message_of_another_version_is_refused_before_its_body():
    body = pack({"wire_version": WIRE_VERSION + 1, "junk": [[i] for i in range(200_000)]})
    assert len(body) < MAX_MESSAGE_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(WireVersionError, match=f"wire version {WIRE_VERSION + 1}"):
            unpack_checked(body, "Offer")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Decoding the body would build 200k lists (~15 MB); the version came first.
    assert peak < 3 * len(body)


def test_forged_garbage_msgpack_is_invalid_argument(control):
    call, offers = control
    good = pack(good_offer().to_dict())
    cases = {
        "truncated": good[:-3],
        "garbage": b"\xc1not msgpack at all",
        "a list": msgpack.packb([WIRE_VERSION, 1, 2]),
        "trailing bytes": good + b"\x00",
        "int keys": msgpack.packb({"wire_version": WIRE_VERSION, 1: 2}),
        "bad field": pack({**good_offer().to_dict(), "num_tokens": "three"}),
        "bad layout": pack({**good_offer().to_dict(), "k": [1, 2]}),
        "bad checksums": pack({**good_offer().to_dict(), "k_checksums": ["x"]}),
        "bad fingerprint": pack({**good_offer().to_dict(), "fingerprint": "X" * 64}),
        "fingerprint not a str": pack({**good_offer().to_dict(), "fingerprint": 7}),
        "empty": b"",
    }
    for name, body in cases.items():
        error = call_status(call, body)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error)
    error = call_status(call, pack({**good_offer().to_dict(), "wire_version": None}))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert offers == []
    call(good, timeout=10)                               # and it still serves
    assert [o.request_id for o in offers] == ["r"]


def test_forged_stream_header_oversized_is_refused_before_decoding():
    # Finding 9: a 16 MB KV-stream header cost 1.1 GB before the version check.
    receiver = grpc_stream.GrpcReceiver()
    try:
        header = pack({"wire_version": WIRE_VERSION, "payload": [[]] * (3 << 20)})
        assert MAX_MESSAGE_BYTES < len(header) < grpc_stream.MAX_MESSAGE_SIZE
        with grpc.insecure_channel(receiver.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.stream_unary(grpc_stream.SEND_METHOD)(iter([header]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than" in info.value.details()
        assert receiver.receive(timeout=None) is None and receiver.num_failed == 1
    finally:
        receiver.close()


def test_forged_stream_header_announcing_gigabytes_allocates_only_what_arrives():
    x = jnp.ones((LAYERS, 1, PAGE_SIZE, 1, 2))
    encoded = grpc_stream.encode_handoff(KVHandoff("big", 3, 5, x, x))
    header = msgpack.unpackb(encoded.header)
    header["arrays"] = [{"name": n, "shape": [1 << 28], "dtype": "float32",
                         "num_bytes": 1 << 30} for n in ("k", "v")]
    header["num_bytes"] = 2 << 30
    tracemalloc.start()
    try:
        with pytest.raises(grpc_stream.TruncatedStreamError, match="truncated"):
            grpc_stream.decode_handoff([msgpack.packb(header), b"\0" * 1000])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ---- KV integrity on the transfer-server path ---------------------------------------

def test_page_checksums_catch_one_changed_value_and_moved_pages():
    x = np.arange(LAYERS * 3 * PAGE_SIZE * 2, dtype=np.float32).reshape(LAYERS, 3, PAGE_SIZE, 1, 2)
    sums = page_checksums(jnp.asarray(x))
    one = x.copy()
    one[1, 2, 3, 0, 1] = np.nextafter(one[1, 2, 3, 0, 1], np.inf)   # one bit
    changed = page_checksums(jnp.asarray(one))
    assert changed[:2] == sums[:2] and changed[2] != sums[2]
    assert page_checksums(jnp.asarray(x[::-1].copy())) != sums          # layers swapped
    assert page_checksums(jnp.asarray(x[:, ::-1].copy())) == sums[::-1]  # pages moved
    for dtype in (jnp.bfloat16, jnp.uint8):
        assert len(page_checksums(jnp.asarray(x, dtype))) == 3


class _DeviceRunner(FakeRunner):
    """`FakeRunner` whose shards are a real device, as the transfer server needs."""

    def shard_sharding(self, shard: int):
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class _Tampering:
    """A transfer server that serves other values than the ones offered: the data
    plane lies, the control plane (the Offer and its checksums) does not."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name):
        return getattr(self._server, name)

    def await_pull(self, uuid, arrays, **kwargs):
        return self._server.await_pull(uuid, [a + 1 for a in arrays], **kwargs)


@pytest.mark.skipif(jax_compat.unavailable_reason() is not None,
                    reason=str(jax_compat.unavailable_reason()))
def test_forged_kv_values_fail_the_checksum_and_request_reprefills(pool, caplog):
    from jaxpd.transfer.transfer_server import (TransferServerOptions, TransferServerReceiver,
                                                TransferServerSender)
    options = TransferServerOptions(pull_timeout_s=5.0, rpc_timeout_s=5.0,
                                    verify_checksums=True)
    decode = TransferServerReceiver(options=options)
    prefill = TransferServerSender(decode_control_address=decode.control_address,
                                   options=options)
    try:
        env = make(pool, remote=True, receiver=decode,
                   runner=_DeviceRunner(1, 2, 17, PAGE_SIZE, LAYERS))
        r = mirror(env, "tampered", prompt_len=5, max_tokens=3)
        genuine = jax.device_put(pages(LAYERS, 2, 1.0, PAGE_SIZE))
        honest_server, prefill._server = prefill._server, _Tampering(prefill._server)
        prefill.send(KVHandoff(r.request_id, 5, 61, genuine, -genuine, payload=r.to_wire()))
        prefill._server = honest_server
        run(env, lambda: r.state is State.WAITING)
        assert "does not hold the bytes the sender checksummed" in caplog.text
        assert env.runner.inserts == []                  # never decoded from them
        assert counts(env)["transfer_failures"] == 1
        # Prefilled again (here by hand: the next token of the fake model), sent honestly.
        assert env.requests.prefill_inbox.get_nowait() is r
        r.transition(State.PREFILLING)
        r.append_token(62, time.perf_counter())
        r.transition(State.TRANSFERRING)
        again = jax.device_put(pages(LAYERS, 2, 2.0, PAGE_SIZE))
        prefill.send(KVHandoff(r.request_id, 6, 62, again, -again, payload=r.to_wire()))
        run(env, lambda: r.is_final)
        assert r.output_ids == [61, 62, 63] and r.finish_reason == "length"
        (_, ids), = env.runner.inserts
        assert np.all(env.runner.k_pool[:, ids] == 2.0)
        assert counts(env)["transfers"] == 1
        assert_no_page_held(env)
        deadline = time.monotonic() + 10
        while prefill.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.pending() == 0 and prefill.reclaimed == 0   # pulled: nothing held
    finally:
        prefill.close()
        decode.close()


def test_checksum_mismatch_is_a_transfer_error():
    assert issubclass(ChecksumMismatchError, grpc_stream.TransferError)


@pytest.mark.skipif(jax_compat.unavailable_reason() is not None,
                    reason=str(jax_compat.unavailable_reason()))
def test_forged_offer_naming_another_host_is_refused():
    """The JAX transfer server's data path has no auth of its own: an Offer (even one
    carrying the cluster token) may not send the decode side to pull from, or ack to,
    a machine other than the one the Offer came from."""
    from jaxpd.transfer.control import ControlClient, address_is_on, peer_ip
    from jaxpd.transfer.transfer_server import TransferServerReceiver
    from jaxpd.transfer.wire import TransferError
    decode = TransferServerReceiver()
    client = ControlClient(decode.control_address)
    try:
        base = good_offer()
        for field in ("transfer_address", "ack_address"):
            offer = dataclasses.replace(base, **{field: "192.0.2.7:8476"})   # TEST-NET-1
            with pytest.raises(TransferError, match=f"{field} .* not on the host"):
                client.offer(offer, timeout=10)
        assert decode.receive(timeout=0) is None
        client.offer(base, timeout=10)                   # loopback to loopback: accepted
        assert decode.receive(timeout=5).request_id == "r"
    finally:
        client.close()
        decode.close()
    assert peer_ip("ipv6:[::1]:5000") == "::1" and peer_ip("unix:/tmp/s") is None
    assert address_is_on("localhost:1", "127.0.0.1") and not address_is_on("192.0.2.7:1",
                                                                           "127.0.0.1")
