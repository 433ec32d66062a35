"""TransferServerSender and TransferServerReceiver across two processes over 127.0.0.1.

A sender subprocess (4 CPU devices, this file run as a script) offers KV pages laid out
two ways; this pytest process (8 devices) is the decode side: it pulls them, places them
on other shardings and compares every number. Also: layout, control-plane and watchdog
failures, each an error rather than a hang or wrong numbers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.transfer import jax_compat
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.control import ControlClient, Offer
from jaxpd.transfer.layout import (ArrayLayout, LayoutMismatchError, WireVersionError,
                                   check_layout, describe, rebuild_sharding)
from jaxpd.transfer.transfer_server import (PullTimeoutError, RemoteKVHandoff,
                                            TransferServerOptions, TransferServerReceiver,
                                            TransferServerSender, TransferServerUnavailable)

ROOT = Path(__file__).resolve().parents[1]
SHAPE_LPSKH = (2, 3, 16, 4, 8)
CHILD_TIMEOUT_S = 60


def pages(case: int) -> np.ndarray:
    """Distinct, exactly representable values per case: k; v is its negation."""
    return np.arange(math.prod(SHAPE_LPSKH), dtype=np.float32).reshape(SHAPE_LPSKH) + 1000 * case


def sender_shardings(devices) -> list[NamedSharding]:
    """Case 0: K over 4 devices on 'tp'. Case 1: a 2x2 mesh in reversed device order,
    L over 'a' and K over 'b'."""
    return [NamedSharding(Mesh(np.array(devices[:4]), ("tp",)), P(None, None, None, "tp")),
            NamedSharding(Mesh(np.array(devices[:4][::-1]).reshape(2, 2), ("a", "b")),
                          P("a", None, None, "b"))]


def _sender_main(decode_control_address: str) -> None:
    """Child process: offer both cases, wait for the acks, hold the server until stdin closes."""
    connector = TransferServerSender(decode_control_address=decode_control_address)
    for case, sharding in enumerate(sender_shardings(jax.devices())):
        k = jax.device_put(pages(case), sharding)
        v = jax.device_put(-pages(case), sharding)
        connector.send(KVHandoff(f"req-{case}", 40, 100 + case, k, v, payload={"case": case}))
    print("SENT", flush=True)
    deadline = time.monotonic() + 30
    while connector.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("ACKED" if connector.pending() == 0 else f"UNACKED {connector.pending()}", flush=True)
    sys.stdin.read()
    connector.close()


class Child:
    """A subprocess with a hard timeout, whose stdout lines can be awaited."""

    def __init__(self, args: list[str], num_devices: int = 4):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}")
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            ["timeout", "-s", "KILL", str(CHILD_TIMEOUT_S), sys.executable, *args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None and self._lines.empty():
                    break
                continue
            if line.startswith(prefix):
                return line
        self._stderr.seek(0)
        raise AssertionError(f"child never printed {prefix!r}; stderr:\n{self._stderr.read()[-3000:]}")

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._stderr.close()


@pytest.fixture(scope="module")
def decode():
    if jax_compat.unavailable_reason() is not None:
        pytest.skip(f"jax {jax.__version__}: {jax_compat.unavailable_reason()}")
    connector = TransferServerReceiver(
        options=TransferServerOptions(pull_timeout_s=2.0, rpc_timeout_s=5.0))
    yield connector
    connector.close()


@pytest.fixture(scope="module")
def remote(decode):
    """The sender subprocess and the two handoffs it offered (pages not pulled yet)."""
    child = Child([__file__, "sender", decode.control_address])
    try:
        child.expect("SENT", timeout=45)
        handoffs = [decode.receive(timeout=10) for _ in range(2)]
        assert all(h is not None for h in handoffs)
        yield child, sorted(handoffs, key=lambda h: h.request_id)
    finally:
        child.stop()


@pytest.mark.slow
def test_pages_arrive_exactly_on_another_sharding(decode, remote):
    child, handoffs = remote
    devices = jax.devices()
    targets = [NamedSharding(Mesh(np.array(devices[4:8]), ("dp",)), P(None, None, None, None, "dp")),
               NamedSharding(Mesh(np.array(devices[6:8]), ("dp",)), P(None, None, "dp"))]
    for case, (handoff, target) in enumerate(zip(handoffs, targets)):
        assert isinstance(handoff, RemoteKVHandoff)
        assert isinstance(handoff.k, jax.ShapeDtypeStruct)  # nothing moved before place
        assert (handoff.request_id, handoff.num_tokens, handoff.first_token, handoff.payload) == (
            f"req-{case}", 40, 100 + case, {"case": case})
        assert handoff.num_pages == 3
        k, v, stats = decode.place(handoff, target)
        assert k.sharding == target and v.sharding == target
        np.testing.assert_array_equal(np.asarray(k), pages(case))
        np.testing.assert_array_equal(np.asarray(v), -pages(case))
        assert stats.num_bytes == k.nbytes + v.nbytes == handoff.num_bytes == 2 * pages(case).nbytes
        assert stats.seconds > 0
    child.expect("ACKED", timeout=15)


@pytest.mark.slow
def test_pull_of_never_offered_uuid_times_out(decode, remote):
    _, handoffs = remote
    fake = dataclasses.replace(handoffs[0].offer, uuid=12345, request_id="ghost")
    handoff = dataclasses.replace(handoffs[0], request_id="ghost", offer=fake)
    start = time.monotonic()
    with pytest.raises(PullTimeoutError, match="did not finish"):
        decode.place(handoff, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_layout_needing_more_devices_is_refused(decode, remote):
    _, handoffs = remote
    wide = dataclasses.replace(handoffs[0].offer.k, mesh_shape=(16,), num_shards=16)
    offer = dataclasses.replace(handoffs[0].offer, uuid=777, k=wide)
    with pytest.raises(LayoutMismatchError, match="needs 16 devices"):
        decode.place(dataclasses.replace(handoffs[0], offer=offer),
                     jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def test_version_skew_on_the_control_plane_is_refused(decode):
    layout = describe(jnp.zeros((1, 1, 16, 4, 8)))
    skewed = Offer(uuid=1, request_id="r", num_tokens=1, first_token=0, k=layout, v=layout,
                   transfer_address="127.0.0.1:1", ack_address="127.0.0.1:1", wire_version=999)
    client = ControlClient(decode.control_address)
    try:
        with pytest.raises(WireVersionError, match="wire version 999"):
            client.offer(skewed, timeout=5)
    finally:
        client.close()
    assert decode.receive(timeout=None) is None


def test_layout_round_trips_through_msgpack_and_mismatch_names_fields():
    sharding = sender_shardings(jax.devices())[1]
    layout = describe(jax.device_put(pages(0), sharding))
    assert layout == ArrayLayout(SHAPE_LPSKH, "float32", (2, 2), ("a", "b"),
                                 ("a", None, None, "b", None), 4)
    again = ArrayLayout.from_dict(msgpack.unpackb(msgpack.packb(layout.to_dict())))
    check_layout(layout, again)
    rebuilt = rebuild_sharding(layout, jax.devices()[4:])
    assert tuple(rebuilt.spec) == layout.spec and rebuilt.mesh.devices.shape == (2, 2)
    other_axis = dataclasses.replace(layout, spec=(None, "a", None, "b", None))
    with pytest.raises(LayoutMismatchError, match="spec: expected"):
        check_layout(layout, other_axis)


def test_unavailable_transfer_server_names_the_fallback(monkeypatch):
    from jax.experimental import transfer as jax_transfer

    def broken(*args, **kwargs):
        raise RuntimeError("no transfer server on this backend")
    monkeypatch.setattr(jax_transfer, "start_transfer_server", broken)
    with pytest.raises(TransferServerUnavailable, match="GrpcSender"):
        TransferServerReceiver()


def test_options_refuse_empty_transport_addresses():
    with pytest.raises(ValueError, match="transport_addresses"):
        TransferServerOptions(transport_addresses=())


@contextlib.contextmanager
def one_offer(decode, request_id: str, **options):
    """A prefill connector that has offered one handoff to `decode`: yields it and the
    decode side's (not yet pulled) handoff; closes it afterwards."""
    prefill = TransferServerSender(decode_control_address=decode.control_address,
                                   options=TransferServerOptions(**options))
    try:
        k = jax.device_put(pages(0), sender_shardings(jax.devices())[0])
        prefill.send(KVHandoff(request_id, 40, 1, k, k))
        assert prefill.pending() == 1
        yield prefill, decode.receive(timeout=5)
    finally:
        prefill.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def assert_pull_fails(decode, handoff) -> None:
    """Nobody can pull the offer any more: the server no longer holds it."""
    with pytest.raises(PullTimeoutError):
        decode.place(handoff, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


@pytest.mark.slow
def test_wait_pulled_returns_when_the_peer_has_pulled(decode):
    """What the prefill loop waits on before its next batch: 1 while the offer is
    unpulled (the wait runs out), 0 once the decode side has pulled and acked it."""
    with one_offer(decode, "pulled", offer_ttl_s=60) as (prefill, handoff):
        assert prefill.wait_pulled(0.05) == 1
        placed = threading.Thread(target=decode.place, args=(
            handoff, jax.sharding.SingleDeviceSharding(jax.devices()[0])))
        placed.start()
        assert prefill.wait_pulled(30) == 0
        placed.join()
        assert prefill.pending() == 0 and prefill.reclaimed == 0


@pytest.mark.slow
def test_offer_ttl_frees_unacked_arrays_and_late_pull_fails(decode):
    with one_offer(decode, "late", offer_ttl_s=0.5) as (prefill, handoff):
        time.sleep(0.8)
        assert prefill.pending() == 0
        assert_pull_fails(decode, handoff)


@pytest.mark.slow
def test_without_server_side_ttl_expired_offers_are_reclaimed(decode, monkeypatch):
    # jax < 0.10.1: await_pull takes no timeout (see transfer.jax_compat), so the
    # connector ends an expired offer itself by pulling it back; a late pull then fails.
    monkeypatch.setattr(jax_compat, "await_pull_takes_timeout", lambda: False)
    with one_offer(decode, "late", offer_ttl_s=0.5) as (prefill, handoff):
        time.sleep(0.8)
        assert prefill.pending() == 0
        wait_until(lambda: prefill.reclaimed)
        assert prefill.reclaimed == 1
        assert_pull_fails(decode, handoff)


@pytest.mark.slow
def test_discarded_offer_is_freed_on_the_sender_at_once(decode):
    # A cancelled request's pending transfer: the decode side never pulls it, and the
    # sender must not hold its pages until the TTL -- in its own bookkeeping nor in the
    # transfer server (which it ends by pulling the offer back once).
    with one_offer(decode, "cancelled", offer_ttl_s=60) as (prefill, handoff):
        decode.discard(handoff)
        wait_until(lambda: not prefill.pending() and prefill.reclaimed)
        assert prefill.pending() == 0
        assert prefill.reclaimed == 1
        assert_pull_fails(decode, handoff)


if __name__ == "__main__":
    if sys.argv[1] == "sender":
        _sender_main(sys.argv[2])
