"""GrpcSender and GrpcReceiver across two processes over 127.0.0.1, and every way a stream can be damaged.

A sender subprocess (4 CPU devices, this file run as a script) streams sharded KV pages
in small chunks; this pytest process is the decode side and places them on another
sharding. Damaged streams (truncated, overrun, bad crc32, other wire version, garbage
header) must be refused with an error on both ends and never be queued.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.transfer import grpc_stream
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.grpc_stream import (ChecksumMismatchError, EncodedHandoff, GrpcReceiver, GrpcSender,
                                  GrpcStreamOptions, MalformedHeaderError, StreamDataError,
                                  TruncatedStreamError, decode_handoff, encode_handoff)
from jaxpd.transfer.layout import WireVersionError

ROOT = Path(__file__).resolve().parents[1]
SHAPE_LPSKH = (2, 3, 16, 4, 8)
CHUNK_SIZE = 1000  # many chunks, and the last one short
CHILD_TIMEOUT_S = 60


def pages(dtype) -> np.ndarray:
    """Values exactly representable in float32 and bfloat16."""
    x = np.arange(math.prod(SHAPE_LPSKH), dtype=np.float32).reshape(SHAPE_LPSKH) % 256 - 128
    return x.astype(dtype)


def _sender_main(decode_address: str) -> None:
    """Child process: stream one float32 and one bfloat16 handoff, K sharded over 'tp'."""
    connector = GrpcSender(decode_address=decode_address,
                              options=GrpcStreamOptions(chunk_size=CHUNK_SIZE, rpc_timeout_s=20))
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("tp",)), P(None, None, None, "tp"))
    for dtype in (np.float32, jnp.bfloat16):
        k = jax.device_put(pages(dtype), sharding)
        v = jax.device_put(-pages(dtype), sharding)
        connector.send(KVHandoff(f"req-{np.dtype(dtype).name}", 40, 7, k, v,
                                 payload={"dtype": np.dtype(dtype).name}))
    print("SENT", flush=True)
    connector.close()


@pytest.fixture(scope="module")
def decode():
    connector = GrpcReceiver(options=GrpcStreamOptions(rpc_timeout_s=10))
    yield connector
    connector.close()


def local_handoff() -> KVHandoff:
    x = jnp.asarray(pages(np.float32))
    return KVHandoff("local", 40, 7, x, -x, payload={"temperature": 0.0})


@pytest.mark.slow
def test_pages_stream_across_processes_exactly(decode):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            ["timeout", "-s", "KILL", str(CHILD_TIMEOUT_S), sys.executable, __file__,
             "sender", decode.address], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            out, _ = proc.communicate(timeout=50)
            stderr.seek(0)
            assert proc.returncode == 0 and "SENT" in out, stderr.read()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    devices = jax.devices()
    target = NamedSharding(Mesh(np.array(devices[4:8]), ("dp",)), P(None, None, None, None, "dp"))
    for dtype in (np.float32, jnp.bfloat16):
        handoff = decode.receive(timeout=5)
        name = np.dtype(dtype).name
        assert (handoff.request_id, handoff.payload) == (f"req-{name}", {"dtype": name})
        k, v, stats = decode.place(handoff, target)
        assert k.dtype == dtype and k.sharding == target
        np.testing.assert_array_equal(np.asarray(k), pages(dtype))
        np.testing.assert_array_equal(np.asarray(v), -pages(dtype))
        assert stats.num_bytes == k.nbytes + v.nbytes == handoff.num_bytes
    assert decode.num_failed == 0


def raw_send(address: str, messages: list[bytes]) -> grpc.RpcError:
    """Send hand-made messages; return the error status the decode side answered."""
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.stream_unary(grpc_stream.SEND_METHOD)(iter(messages), timeout=10)
    return info.value


def with_header(encoded: EncodedHandoff, **changes) -> list[bytes]:
    header = msgpack.unpackb(encoded.header)
    header.update(changes)
    return [msgpack.packb(header)] + list(encoded.messages(CHUNK_SIZE))[1:]


def test_damaged_streams_are_refused_and_never_queued(decode):
    encoded = encode_handoff(local_handoff())
    good = list(encoded.messages(CHUNK_SIZE))
    flipped = bytes([good[3][0] ^ 1]) + good[3][1:]
    cases = {
        "truncated": (good[:-1], grpc.StatusCode.DATA_LOSS, "truncated"),
        "overrun": (good + [b"x"], grpc.StatusCode.DATA_LOSS, "more bytes"),
        "checksum": (good[:3] + [flipped] + good[4:], grpc.StatusCode.DATA_LOSS, "crc32"),
        "no header": ([], grpc.StatusCode.DATA_LOSS, "before its header"),
        "version": (with_header(encoded, wire_version=999),
                    grpc.StatusCode.FAILED_PRECONDITION, "wire version 999"),
        "garbage": ([b"\xc1not msgpack"] + good[1:], grpc.StatusCode.INVALID_ARGUMENT, "msgpack"),
    }
    failed_before = decode.num_failed
    for name, (messages, code, text) in cases.items():
        error = raw_send(decode.address, messages)
        assert error.code() == code and text in error.details(), (name, error)
    assert decode.num_failed - failed_before == len(cases)
    assert decode.receive(timeout=None) is None


def test_sender_raises_what_the_receiver_refused(decode, monkeypatch):
    sender = GrpcSender(decode_address=decode.address,
                           options=GrpcStreamOptions(chunk_size=CHUNK_SIZE))
    try:
        real_messages = EncodedHandoff.messages
        monkeypatch.setattr(EncodedHandoff, "messages",
                            lambda self, n: iter(list(real_messages(self, n))[:-2]))
        with pytest.raises(StreamDataError, match="truncated"):
            sender.send(local_handoff())
        monkeypatch.undo()
        skewed = grpc_stream.WIRE_VERSION + 1
        monkeypatch.setattr(grpc_stream, "WIRE_VERSION", skewed)
        with pytest.raises(WireVersionError, match=f"wire version {skewed}"):
            sender.send(local_handoff())
        monkeypatch.undo()
        sender.send(local_handoff())
        handoff = decode.receive(timeout=5)
        assert handoff.request_id == "local" and handoff.payload == {"temperature": 0.0}
        np.testing.assert_array_equal(handoff.k, pages(np.float32))
    finally:
        sender.close()


def test_decode_handoff_pure_checks():
    encoded = encode_handoff(local_handoff())
    good = list(encoded.messages(CHUNK_SIZE))
    assert decode_handoff(good).num_bytes == 2 * pages(np.float32).nbytes
    received = sum(len(m) for m in good[1:-1])
    with pytest.raises(TruncatedStreamError, match=f"after {received} of 24576"):
        decode_handoff(good[:-1])
    with pytest.raises(ChecksumMismatchError):
        decode_handoff(good[:-1] + [good[-1][:-1] + bytes([good[-1][-1] ^ 1])])
    with pytest.raises(WireVersionError):
        decode_handoff(with_header(encoded, wire_version=0))
    with pytest.raises(MalformedHeaderError, match="not the sum"):
        decode_handoff(with_header(encoded, num_bytes=10, crc32=0))
    with pytest.raises(MalformedHeaderError, match="limit"):
        decode_handoff(good, max_bytes=100)


def test_payload_must_be_msgpackable():
    handoff = local_handoff()
    handoff.payload = {"when": time}  # a module: not serialisable
    with pytest.raises(TypeError, match="msgpack-able"):
        encode_handoff(handoff)


if __name__ == "__main__":
    if sys.argv[1] == "sender":
        _sender_main(sys.argv[2])
