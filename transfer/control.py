"""The control plane of the cross-process transfer: Offer and Ack over gRPC.

No protobuf codegen: two unary methods registered with
`grpc.method_handlers_generic_handler`, bodies are msgpack maps. The data itself never
travels here; an `Offer` says where to pull it from (`transfer_address`, `uuid`) and
in which layout, an `Ack` tells the sender it may drop its arrays.

Every message carries `wire_version`; a server that receives another version answers
FAILED_PRECONDITION and the client raises `WireVersionError`, so version skew is an
error on both sides, never a misread message. Bodies are peer input: gRPC refuses one
over `MAX_MESSAGE_BYTES` before it reaches us, and the handler decodes it itself with
`unpack_checked` (size and container limits, version first), so truncated or garbage
bytes are INVALID_ARGUMENT -- a deserializer that raises inside gRPC would be INTERNAL.

Threads: a `ControlServer` runs gRPC's own thread pool (`max_workers`); handlers only
validate and hand the message to a callback.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any

import grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.models.fingerprint import is_fingerprint
from jaxpd.transfer.connector import KVPart
from jaxpd.transfer.layout import ArrayLayout
from jaxpd.transfer.wire import (MAX_MESSAGE_BYTES, WIRE_VERSION, MalformedMessage,
                                 TransferError, WireVersionError, check_wire_version, pack,
                                 unpack, unpack_checked)

SERVICE = "jaxpd.transfer.Control"
OFFER_METHOD = f"/{SERVICE}/Offer"
ACK_METHOD = f"/{SERVICE}/Ack"

# Room for gRPC's own framing around the largest body `unpack_checked` takes.
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + 1024)]

_log = logging.getLogger(__name__)


class BackpressureError(TransferError):
    """The receiving side's queue stayed full: it cannot take another handoff now."""


MAX_PIECES = 64      # kv-head ranges of one Offer (a tp wider than this is not one we serve)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Some kv heads of an Offer's pages, waiting in one process's transfer server under
    `uuid`: a prefill mesh spanning processes offers each process's own shards
    (`engine.multihost.shard_offers`). The pull is `k` then `v`, one array per range of `heads`
    ([start, stop) in order), each [L, P, S, stop - start, H]; `k_checksums[i]` are the
    crc32s of `k[i]`'s pages (None: the sender has checksums off)."""
    transfer_address: str
    uuid: int
    heads: tuple[tuple[int, int], ...]
    k: tuple[ArrayLayout, ...]
    v: tuple[ArrayLayout, ...]
    k_checksums: tuple[tuple[int, ...], ...] | None = None
    v_checksums: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        sums = lambda s: None if s is None else [list(x) for x in s]
        return {"transfer_address": self.transfer_address, "uuid": self.uuid,
                "heads": [list(h) for h in self.heads], "k": [x.to_dict() for x in self.k],
                "v": [x.to_dict() for x in self.v], "k_checksums": sums(self.k_checksums),
                "v_checksums": sums(self.v_checksums)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Piece:
        heads = d["heads"]
        if not isinstance(heads, list) or not 0 < len(heads) <= MAX_PIECES or not all(
                isinstance(h, list) and len(h) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in h) for h in heads):
            raise ValueError("piece heads must be 1 to 64 [start, stop] pairs of ints")
        def layouts(name: str) -> tuple[ArrayLayout, ...]:
            value = d[name]
            if not isinstance(value, list) or len(value) != len(heads):
                raise ValueError(f"piece {name}: one layout per head range")
            return tuple(ArrayLayout.from_dict(x) for x in value)
        def sums(name: str):
            value = d.get(name)
            if value is None:
                return None
            if not isinstance(value, list) or len(value) != len(heads):
                raise ValueError(f"piece {name}: one checksum list per head range")
            return tuple(_checksums(x, name) for x in value)
        return cls(transfer_address=str(d["transfer_address"]), uuid=int(d["uuid"]),
                   heads=tuple((h[0], h[1]) for h in heads), k=layouts("k"), v=layouts("v"),
                   k_checksums=sums("k_checksums"), v_checksums=sums("v_checksums"))

    def check(self, k: ArrayLayout, v: ArrayLayout) -> None:
        """Raise ValueError unless every array is a head range of `k` / `v` (the whole
        arrays the Offer announces), with checksums for each of its pages."""
        for name, whole, parts, sums in (("k", k, self.k, self.k_checksums),
                                         ("v", v, self.v, self.v_checksums)):
            for (start, stop), part in zip(self.heads, parts):
                if len(whole.shape) != 5 or not 0 <= start < stop <= whole.shape[3] or \
                        part.shape != (*whole.shape[:3], stop - start, whole.shape[4]) or \
                        part.dtype != whole.dtype:
                    raise ValueError(f"piece {self.uuid}: {name} heads [{start}, {stop}) "
                                     f"{list(part.shape)} {part.dtype} is not a head range of "
                                     f"{list(whole.shape)} {whole.dtype}")
            if sums is not None and any(len(s) != whole.shape[1] for s in sums):
                raise ValueError(f"piece {self.uuid}: {name}_checksums need one value per page")


@dataclasses.dataclass(frozen=True)
class Offer:
    """Prefill → decode: a finished prefill whose KV waits on `transfer_address`.

    `payload` must be msgpack-able (the request's ids, sampling params, timings).
    `k_checksums`/`v_checksums`: the crc32 of each page (`transfer.checksum`; None when
    the sender does not compute them); they travel with `first_token` on the
    authenticated control plane and bind the data plane's bytes to it.
    `pieces` (a prefill mesh spanning processes, `engine.multihost.shard_offers`): the pages wait
    in several transfer servers, each piece some kv heads; `k` and `v` then describe
    the whole arrays, `uuid` names the Offer (and the sender's own piece), and the
    pieces' heads cover every kv head exactly once.
    `fingerprint`: the sender's model (`models.fingerprint`); the decode side refuses
    an Offer of another model before it pulls anything.
    """
    uuid: int
    request_id: str
    num_tokens: int
    first_token: int
    k: ArrayLayout
    v: ArrayLayout
    transfer_address: str
    ack_address: str
    payload: Any = None
    part: KVPart | None = None
    k_checksums: tuple[int, ...] | None = None
    v_checksums: tuple[int, ...] | None = None
    first_page: int = 0
    pieces: tuple[Piece, ...] = ()
    fingerprint: str = ""
    wire_version: int = WIRE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"wire_version": self.wire_version, "part": self.part and self.part.to_dict(),
            "pieces": [p.to_dict() for p in self.pieces],
            "uuid": self.uuid,
            "request_id": self.request_id, "num_tokens": self.num_tokens,
            "first_token": self.first_token, "k": self.k.to_dict(), "v": self.v.to_dict(),
            "transfer_address": self.transfer_address, "ack_address": self.ack_address,
            "payload": self.payload,
            "k_checksums": _plain(self.k_checksums), "v_checksums": _plain(self.v_checksums),
            "first_page": self.first_page, "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Offer:
        check_wire_version(d.get("wire_version"), "Offer")
        offer = cls(uuid=int(d["uuid"]), request_id=str(d["request_id"]),
                    num_tokens=int(d["num_tokens"]), first_token=int(d["first_token"]),
                    k=ArrayLayout.from_dict(d["k"]), v=ArrayLayout.from_dict(d["v"]),
                    transfer_address=str(d["transfer_address"]),
                    ack_address=str(d["ack_address"]), payload=d.get("payload"),
                    part=KVPart.from_dict(d.get("part")),
                    k_checksums=_checksums(d.get("k_checksums"), "k_checksums"),
                    v_checksums=_checksums(d.get("v_checksums"), "v_checksums"),
                    first_page=int(d.get("first_page", 0)),
                    pieces=_pieces(d.get("pieces")),
                    fingerprint=check_fingerprint(d.get("fingerprint", "")))
        if offer.pieces:
            for piece in offer.pieces:
                piece.check(offer.k, offer.v)
            heads = sorted(h for piece in offer.pieces for h in piece.heads)
            if [h[0] for h in heads] != [0] + [h[1] for h in heads[:-1]] or \
                    heads[-1][1] != offer.k.shape[3]:
                raise ValueError(f"pieces' kv heads {heads} do not cover [0, "
                                 f"{offer.k.shape[3]}) exactly once")
        for name, sums, layout in (("k", offer.k_checksums, offer.k),
                                   ("v", offer.v_checksums, offer.v)):
            if sums is not None and (len(layout.shape) < 2 or len(sums) != layout.shape[1]):
                raise ValueError(f"{name}_checksums: {len(sums)} values for the pages of "
                                 f"{name} {list(layout.shape)}")
        return offer


def check_fingerprint(value: Any) -> str:
    """A peer's `fingerprint` field: "" or 64 lower-case hex digits."""
    if value == "" or is_fingerprint(value):
        return value
    raise ValueError("fingerprint must be empty or 64 lower-case hex digits")


def _pieces(value: Any) -> tuple[Piece, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_PIECES:
        raise ValueError(f"pieces must be a list of at most {MAX_PIECES}")
    return tuple(Piece.from_dict(p) for p in value)


def _plain(sums: tuple[int, ...] | None) -> list[int] | None:
    return None if sums is None else list(sums)


def _checksums(value: Any, field: str) -> tuple[int, ...] | None:
    """A list of uint32 page checksums, or None."""
    if value is None:
        return None
    if not isinstance(value, list) or any(
            isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**32 for x in value):
        raise ValueError(f"{field} must be a list of uint32 values")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Ack:
    """Decode → prefill: the pull of `uuid` is over; `error` is empty when it succeeded.
    `pulled`: of a pieces Offer that failed, the pieces whose pull completed (the sender
    ends the others)."""
    uuid: int
    error: str = ""
    pulled: tuple[int, ...] = ()
    wire_version: int = WIRE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"wire_version": self.wire_version, "uuid": self.uuid, "error": self.error,
                "pulled": list(self.pulled)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ack:
        check_wire_version(d.get("wire_version"), "Ack")
        pulled = d.get("pulled", [])
        if not isinstance(pulled, list) or len(pulled) > MAX_PIECES:
            raise ValueError(f"pulled must be a list of at most {MAX_PIECES} uuids")
        return cls(uuid=int(d["uuid"]), error=str(d.get("error", "")),
                   pulled=tuple(int(u) for u in pulled))


OfferHandler = Callable[[Offer, float | None, str], None]
AckHandler = Callable[[Ack], None]


class ControlServer:
    """Serves Offer and/or Ack on `address` ("host:0" picks a free port).

    `on_offer(offer, seconds_left, peer)` may block up to `seconds_left` for
    backpressure and raises `BackpressureError` when it gives up; `peer` is grpc's
    address of the caller ("ipv4:10.0.0.5:41234").
    """

    def __init__(self, address: str, *, on_offer: OfferHandler | None = None,
                 on_ack: AckHandler | None = None, max_workers: int = 4,
                 auth: InternalAuth = NO_AUTH):
        handlers = {}
        if on_offer is not None:
            handlers["Offer"] = self._unary("Offer", lambda d, ctx: on_offer(
                Offer.from_dict(d), ctx.time_remaining(), ctx.peer()))
        if on_ack is not None:
            handlers["Ack"] = self._unary("Ack", lambda d, ctx: on_ack(Ack.from_dict(d)))
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="control"),
            interceptors=auth.server_interceptors(), options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            port = auth.add_port(self._server, address)
        except OSError as e:
            raise TransferError(f"control server: {e}") from None
        self.address = f"{address.rsplit(':', 1)[0]}:{port}"
        self._server.start()

    @staticmethod
    def _unary(name: str, handle: Callable[[dict[str, Any], grpc.ServicerContext], None]):
        def serve(request: bytes, context: grpc.ServicerContext) -> dict[str, Any]:
            try:
                handle(unpack_checked(request, name), context)
            except WireVersionError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except BackpressureError as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except MalformedMessage as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except (KeyError, TypeError, ValueError, AttributeError, TransferError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed message: {type(e).__name__}: {e}")
            return {}
        # Bytes in: decoded in `serve`, where a bad body can be answered properly.
        return grpc.unary_unary_rpc_method_handler(
            serve, request_deserializer=None, response_serializer=pack)

    def stop(self) -> None:
        self._server.stop(grace=None)


class ControlClient:
    """Sends Offers and Acks to one peer's `ControlServer`."""

    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address = address
        self._channel = auth.channel(address)
        self._offer = self._channel.unary_unary(
            OFFER_METHOD, request_serializer=pack, response_deserializer=unpack)
        self._ack = self._channel.unary_unary(
            ACK_METHOD, request_serializer=pack, response_deserializer=unpack)

    def offer(self, offer: Offer, timeout: float) -> None:
        """Deliver `offer`; raises a `TransferError` subclass saying why it was refused."""
        self._call(self._offer, offer.to_dict(), timeout)

    def ack(self, ack: Ack, timeout: float) -> None:
        """Tell the sender its arrays may go; failures are logged, not raised, because
        the sender frees them after its TTL anyway."""
        future = self._ack.future(ack.to_dict(), timeout=timeout)
        future.add_done_callback(lambda f: f.exception() and _log.warning(
            "ack of uuid %d to %s failed: %s", ack.uuid, self.address, f.exception()))

    def _call(self, stub, message: dict[str, Any], timeout: float) -> None:
        try:
            stub(message, timeout=timeout)
        except grpc.RpcError as e:
            raise error_of(e, self.address) from e

    def close(self) -> None:
        self._channel.close()


def error_of(e: grpc.RpcError, address: str) -> TransferError:
    """The `TransferError` subclass that a refused control call stands for."""
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return WireVersionError(f"{address} refused the message: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BackpressureError(f"{address} is full: {details}")
    return TransferError(f"control call to {address} failed: {code.name}: {details}")


def peer_ip(peer: str) -> str | None:
    """The IP of a grpc peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5"); None otherwise."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return rest.rsplit(":", 1)[0].strip("[]")


@functools.lru_cache(maxsize=256)
def _ips_of(host: str) -> frozenset[str]:
    try:
        return frozenset(a[4][0] for a in socket.getaddrinfo(host, None))
    except OSError:
        return frozenset()


def address_on_any(address: str, hosts: tuple[str, ...]) -> bool:
    """`address` is on one of `hosts` (names or IPs)."""
    return any(address_is_on(address, ip) for host in hosts for ip in _ips_of(host))


def address_is_on(address: str, ip: str | None) -> bool:
    """`address` ("host:port") names the host `ip` (both loopback counts as the same
    host): an Offer may only send the decode side to the machine the Offer came from."""
    if ip is None:
        return False
    ips = _ips_of(address.rsplit(":", 1)[0].strip("[]"))
    loopback = lambda a: ipaddress.ip_address(a).is_loopback
    return ip in ips or (loopback(ip) and bool(ips) and all(loopback(a) for a in ips))

