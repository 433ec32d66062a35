"""KV pages as a gRPC byte stream: the fallback when no JAX transfer server is usable.

Wire format, one client-streaming call `/jaxpd.transfer.KVStream/Send` per handoff:
  message 0   msgpack header: wire_version, request_id, num_tokens, first_token,
              payload, fingerprint (the sender's model), part (layer-wise: stream, index, count, layer_start),
              arrays [{name, shape, dtype, num_bytes}], num_bytes, crc32
  message 1.. raw bytes, at most `chunk_size` (<= 4 MiB, gRPC's default message cap),
              k's bytes then v's, C order.
The receiver answers an empty map, or a status the sender raises as an error:
FAILED_PRECONDITION version skew, DATA_LOSS fewer/more bytes than announced or a
crc32 mismatch, INVALID_ARGUMENT malformed header, RESOURCE_EXHAUSTED queue full.
A damaged stream is never queued, so it can only cost a retry, not wrong tokens.
The header is the stream's control message: a receiver told its model
(`expect_model`) compares the header's fingerprint with it before it reads one byte of
the body. A stream of another model is answered OK with its body unread, and queued
bodiless (`StreamedKVHandoff.refused`) so the decode loop refuses it like any other
handoff of another model (`transfer.inbound.ModelMismatch`): counted, nothing placed,
the request prefilled again on the decode side.
The header is peer input: one over `MAX_HEADER_SIZE` is refused before it is decoded,
it is decoded with `unpack_checked`'s limits (version first), and the body's buffer
grows with the bytes that actually arrive, never to the size a header announces.

The pages travel through host memory on both ends (gather, bytes, `device_put`), which
is why this is the fallback and not the default.

Threads: the decode side runs one gRPC server (its own small pool); each stream is
decoded on a pool thread and queued (bounded: a full queue pushes back on the sender).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.transfer.connector import KVHandoff, KVPart, TransferStats, next_or_none
from jaxpd.transfer.control import BackpressureError, check_fingerprint, error_of
from jaxpd.transfer.wire import (MAX_MESSAGE_BYTES, WIRE_VERSION, MalformedMessage,
                                 TransferError, WireVersionError, pack, unpack,
                                 unpack_checked)

SERVICE = "jaxpd.transfer.KVStream"
SEND_METHOD = f"/{SERVICE}/Send"
MiB = 1 << 20
MAX_CHUNK_SIZE = 4 * MiB
# A header carries the request's wire form: a control message's bound.
MAX_HEADER_SIZE = MAX_MESSAGE_BYTES
# gRPC's own cap on any one message of the stream (a chunk, or the header).
MAX_MESSAGE_SIZE = MAX_CHUNK_SIZE + 1024

_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_SIZE),
           ("grpc.max_send_message_length", MAX_MESSAGE_SIZE)]
_log = logging.getLogger(__name__)


class StreamDataError(TransferError):
    """The bytes that arrived are not the bytes that were announced."""


class TruncatedStreamError(StreamDataError):
    """The stream ended before (or ran past) the announced number of bytes."""


class ChecksumMismatchError(StreamDataError):
    """All bytes arrived but their crc32 differs from the header's."""


class MalformedHeaderError(TransferError):
    """The first message is not a valid stream header."""


@dataclasses.dataclass(frozen=True)
class GrpcStreamOptions:
    """chunk_size: bytes per stream message; max_handoff_bytes: refuse larger
    announcements before allocating for them. A send's deadline is `rpc_timeout_s`
    plus one second per `min_bytes_per_s` bytes: short for the usual few-MB handoff, so
    a frozen decode side (SIGSTOP: TCP open, nobody answering) holds the prefill loop
    for seconds, not a minute."""
    chunk_size: int = MAX_CHUNK_SIZE
    rpc_timeout_s: float = 5.0
    min_bytes_per_s: float = 100e6
    max_pending: int = 64
    max_handoff_bytes: int = 16 << 30

    def __post_init__(self):
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK_SIZE}], got {self.chunk_size}")
        if (self.rpc_timeout_s <= 0 or self.max_pending <= 0 or self.max_handoff_bytes <= 0
                or self.min_bytes_per_s <= 0):
            raise ValueError("rpc_timeout_s, max_pending, max_handoff_bytes and "
                             "min_bytes_per_s must be positive")


@dataclasses.dataclass
class StreamedKVHandoff(KVHandoff):
    """A handoff received over the stream: k and v are host numpy arrays until `place`.

    `stream_seconds`: first to last message, so stats cover the whole move.
    """
    stream_seconds: float = dataclasses.field(kw_only=True)
    # Why the body was never read ("": it was): k and v are then only
    # `jax.ShapeDtypeStruct`s and `place` refuses.
    refused: str = dataclasses.field(default="", kw_only=True)


@dataclasses.dataclass(frozen=True)
class EncodedHandoff:
    """A handoff ready to stream: packed header plus k's and v's bytes (no copy yet)."""
    header: bytes
    body: tuple[memoryview, ...]

    @property
    def num_bytes(self) -> int:
        return len(self.header) + sum(buf.nbytes for buf in self.body)

    def messages(self, chunk_size: int = MAX_CHUNK_SIZE) -> Iterator[bytes]:
        yield self.header
        for buf in self.body:
            for start in range(0, len(buf), chunk_size):
                yield bytes(buf[start:start + chunk_size])


def encode_handoff(handoff: KVHandoff) -> EncodedHandoff:
    """Gather k and v to host, checksum them and pack the header."""
    arrays = {"k": np.ascontiguousarray(np.asarray(handoff.k)),
              "v": np.ascontiguousarray(np.asarray(handoff.v))}
    body = tuple(memoryview(a.reshape(-1).view(np.uint8)) for a in arrays.values())
    crc = 0
    for buf in body:
        crc = zlib.crc32(buf, crc)
    header = {
        "wire_version": WIRE_VERSION, "request_id": handoff.request_id,
        "num_tokens": handoff.num_tokens, "first_token": handoff.first_token,
        "payload": handoff.payload, "part": handoff.part and handoff.part.to_dict(),
        "first_page": handoff.first_page, "fingerprint": handoff.fingerprint,
        "arrays": [{"name": name, "shape": list(a.shape), "dtype": a.dtype.name,
                    "num_bytes": a.nbytes} for name, a in arrays.items()],
        "num_bytes": sum(len(b) for b in body), "crc32": crc,
    }
    try:
        packed = pack(header)
    except (TypeError, ValueError) as e:
        raise TypeError(f"payload of {handoff.request_id!r} must be msgpack-able "
                        f"(dicts, lists, str, numbers, bytes): {e}") from e
    if len(packed) > MAX_HEADER_SIZE:
        raise ValueError(f"stream header is {len(packed)} bytes, over {MAX_HEADER_SIZE}: "
                         "the payload is too large")
    return EncodedHandoff(packed, body)


@dataclasses.dataclass(frozen=True)
class _ArraySpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class _Header:
    """A checked stream header: every field present and consistent."""
    request_id: str
    num_tokens: int
    first_token: int
    payload: Any
    part: KVPart | None
    first_page: int
    fingerprint: str
    arrays: tuple[_ArraySpec, ...]
    num_bytes: int
    crc32: int


def _parse_header(message: bytes, max_bytes: int) -> _Header:
    try:
        d = unpack_checked(message, "KV stream header", MAX_HEADER_SIZE)
    except MalformedMessage as e:
        raise MalformedHeaderError(f"stream header is not msgpack within limits: {e}") from None
    try:
        header = _Header(
            request_id=str(d["request_id"]), num_tokens=int(d["num_tokens"]),
            first_token=int(d["first_token"]), payload=d.get("payload"),
            part=KVPart.from_dict(d.get("part")),
            first_page=int(d.get("first_page", 0)),
            fingerprint=check_fingerprint(d.get("fingerprint", "")),
            arrays=tuple(_ArraySpec(str(a["name"]), tuple(int(n) for n in a["shape"]),
                                    jnp.dtype(a["dtype"]), int(a["num_bytes"]))
                         for a in d["arrays"]),
            num_bytes=int(d["num_bytes"]), crc32=int(d["crc32"]))
    except (KeyError, TypeError, ValueError) as e:
        raise MalformedHeaderError(f"stream header lacks or garbles a field: {e!r}") from e
    names = [a.name for a in header.arrays]
    if names != ["k", "v"]:
        raise MalformedHeaderError(f"stream must carry arrays k then v, got {names}")
    for a in header.arrays:
        if a.num_bytes != math.prod(a.shape) * a.dtype.itemsize:
            raise MalformedHeaderError(f"{a.name}: {a.num_bytes} bytes announced for "
                                       f"{a.shape} {a.dtype}")
    if header.num_bytes != sum(a.num_bytes for a in header.arrays):
        raise MalformedHeaderError(f"num_bytes {header.num_bytes} is not the sum of the arrays'")
    if header.num_bytes > max_bytes:
        raise MalformedHeaderError(f"{header.num_bytes} bytes announced, limit is {max_bytes}")
    return header


def decode_handoff(messages: Iterable[bytes],
                   max_bytes: int = GrpcStreamOptions.max_handoff_bytes,
                   fingerprint: str = "") -> StreamedKVHandoff:
    """Rebuild a handoff from stream messages; raise rather than return damaged pages.
    With `fingerprint` set, a header naming another model ends the reading there: the
    handoff comes back bodiless, `refused` saying why (nothing past the header is read)."""
    it = iter(messages)
    try:
        first = next(it)
    except StopIteration:
        raise TruncatedStreamError("stream ended before its header") from None
    start = time.perf_counter()
    header = _parse_header(first, max_bytes)
    total, who = header.num_bytes, repr(header.request_id)
    if fingerprint and header.fingerprint != fingerprint:
        k, v = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in header.arrays)
        return StreamedKVHandoff(
            request_id=header.request_id, num_tokens=header.num_tokens,
            first_token=header.first_token, k=k, v=v, payload=header.payload,
            part=header.part, first_page=header.first_page,
            fingerprint=header.fingerprint, stream_seconds=time.perf_counter() - start,
            refused=f"{who}: the stream names model {header.fingerprint[:12]!r}, this "
                    f"receiver takes {fingerprint[:12]!r}: its body was not read")
    # Grown as bytes arrive: a header that announces gigabytes and sends none costs none.
    buf = bytearray()
    offset, crc = 0, 0
    for chunk in it:
        if offset + len(chunk) > total:
            raise TruncatedStreamError(f"{who}: more bytes than the {total} announced")
        buf += chunk
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    if offset != total:
        raise TruncatedStreamError(f"{who}: stream truncated after {offset} of {total} "
                                   f"announced bytes")
    if crc != header.crc32:
        raise ChecksumMismatchError(f"{who}: crc32 {crc:#010x} of the received bytes, "
                                    f"header says {header.crc32:#010x}")
    arrays, at = {}, 0
    for a in header.arrays:
        arrays[a.name] = np.frombuffer(buf, dtype=a.dtype, count=a.num_bytes // a.dtype.itemsize,
                                       offset=at).reshape(a.shape)
        at += a.num_bytes
    return StreamedKVHandoff(
        request_id=header.request_id, num_tokens=header.num_tokens,
        first_token=header.first_token, k=arrays["k"], v=arrays["v"],
        payload=header.payload, part=header.part, first_page=header.first_page,
        fingerprint=header.fingerprint, stream_seconds=time.perf_counter() - start)


_STATUS_OF = {
    WireVersionError: grpc.StatusCode.FAILED_PRECONDITION,
    StreamDataError: grpc.StatusCode.DATA_LOSS,
    MalformedHeaderError: grpc.StatusCode.INVALID_ARGUMENT,
    BackpressureError: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class GrpcSender:
    """`KVSender` over a gRPC byte stream to decode sides in other processes: streams to
    each handoff's `destination` (a `GrpcReceiver.address`), or to `decode_address`
    when it has none."""

    def __init__(self, *, decode_address: str | None = None,
                 options: GrpcStreamOptions = GrpcStreamOptions(), auth: InternalAuth = NO_AUTH):
        self.address = decode_address
        self._auth = auth
        self.options = options
        self._closed = False
        self._lock = threading.Lock()
        self._senders: dict[str, tuple[grpc.Channel, Callable]] = {}

    def send(self, handoff: KVHandoff) -> None:
        """Stream the pages; returns once the decode side has checked and queued them."""
        if self._closed:
            raise TransferError("GrpcSender is closed")
        encoded = encode_handoff(handoff)
        address = handoff.destination or self.address
        if address is None:
            raise TransferError(f"handoff {handoff.request_id!r} names no decode destination "
                                f"and the connector has no default")
        try:
            timeout = (self.options.rpc_timeout_s
                       + encoded.num_bytes / self.options.min_bytes_per_s)
            self._sender(address)(encoded.messages(self.options.chunk_size), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DATA_LOSS:
                raise StreamDataError(f"{address} rejected the stream of "
                                      f"{handoff.request_id!r}: {e.details()}") from e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise MalformedHeaderError(f"{address}: {e.details()}") from e
            raise error_of(e, address) from e

    def _sender(self, address: str) -> Callable:
        with self._lock:
            if address not in self._senders:
                channel = self._auth.channel(address, options=_LIMITS)
                self._senders[address] = (channel, channel.stream_unary(
                    SEND_METHOD, request_serializer=None, response_deserializer=unpack))
            return self._senders[address][1]

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for channel, _ in self._senders.values():
                channel.close()


class GrpcReceiver:
    """`KVReceiver` over a gRPC byte stream: serves on `address` ("host:0" picks a
    port; see `.address`), checks each stream (sizes, crc32, wire version) before
    queueing it."""

    def __init__(self, *, address: str = "127.0.0.1:0",
                 options: GrpcStreamOptions = GrpcStreamOptions(), auth: InternalAuth = NO_AUTH):
        self.options = options
        self.num_failed = 0
        self.fingerprint = ""      # the model it takes (`expect_model`); "": any
        self._closed = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[StreamedKVHandoff] = queue.Queue(maxsize=options.max_pending)
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-stream"),
            options=_LIMITS, interceptors=auth.server_interceptors())
        handler = grpc.stream_unary_rpc_method_handler(
            self._serve, request_deserializer=None, response_serializer=pack)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Send": handler}),))
        try:
            port = auth.add_port(self._server, address)
        except OSError as e:
            raise TransferError(f"KV stream server: {e}") from None
        self.address = f"{address.rsplit(':', 1)[0]}:{port}"
        self._server.start()

    def expect_model(self, fingerprint: str) -> None:
        """The model (`models.fingerprint`) this receiver's decode pool serves: a stream
        whose header names another is not read past its header (see the module doc).
        "": every stream is read (the decode loop still checks each handoff)."""
        self.fingerprint = fingerprint

    def _serve(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> dict:
        try:
            handoff = decode_handoff(messages, self.options.max_handoff_bytes,
                                     self.fingerprint)
            if self._closed:
                raise BackpressureError("decode side is closed")
            try:
                self._queue.put(handoff, timeout=max(0.0, (context.time_remaining() or 1.0) - 0.1))
            except queue.Full:
                raise BackpressureError(
                    f"{self._queue.maxsize} handoffs already wait to be placed") from None
        except tuple(_STATUS_OF) as e:
            self._count_failure(e)
            context.abort(next(s for t, s in _STATUS_OF.items() if isinstance(e, t)), str(e))
        except grpc.RpcError:
            # The request iterator raises this when the sender cancels or dies mid-stream;
            # nobody is left to answer, so only count it.
            self._count_failure(TruncatedStreamError("sender cancelled the stream"))
        return {}

    def _count_failure(self, error: Exception) -> None:
        with self._lock:
            self.num_failed += 1
        _log.warning("rejected a KV stream: %s: %s", type(error).__name__, error)

    def receive(self, timeout: float | None) -> StreamedKVHandoff | None:
        """The next checked handoff; None after `timeout` seconds (None or 0: do not
        wait), like `DevicePutConnector`."""
        if self._closed:
            raise TransferError("GrpcReceiver is closed")
        return next_or_none(self._queue, timeout)

    def place(self, handoff: StreamedKVHandoff, sharding: jax.sharding.Sharding
              ) -> tuple[jax.Array, jax.Array, TransferStats]:
        """Host pages onto `sharding`; the stats include the time spent streaming."""
        if handoff.refused:
            raise TransferError(handoff.refused)
        start = time.perf_counter()
        k, v = jax.block_until_ready(jax.device_put((handoff.k, handoff.v), sharding))
        seconds = time.perf_counter() - start + handoff.stream_seconds
        return k, v, TransferStats(int(k.nbytes) + int(v.nbytes), seconds)

    def discard(self, handoff: StreamedKVHandoff) -> None:
        """Nothing to do: the bytes already arrived; the sender kept no copy."""

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"kv_streams_rejected": self.num_failed}

    def close(self) -> None:
        self._closed = True
        self._server.stop(grace=None)
