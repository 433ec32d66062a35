"""What every cross-process message shares: msgpack bodies, the wire-format version,
and the errors a transfer can end in.

Plain Python (msgpack, no jax): the router speaks this wire to the role processes
and must not load jax; the transfer modules that move arrays build on it.

A peer's bytes are untrusted: `unpack_checked` refuses a body over `MAX_MESSAGE_BYTES`
before decoding anything, decodes with msgpack's container limits (so a small body
cannot make a huge allocation), and checks `wire_version` as soon as it is read --
`pack` writes it first -- before the rest of the body is decoded.
"""
from __future__ import annotations

from typing import Any

import msgpack

# Bump on any change to Offer/Ack, the stream header, ArrayLayout's dict form or the
# role RPC bodies.
WIRE_VERSION = 6   # 2: layer-wise parts (`KVPart`); 3: per-page checksums in the Offer;
                   # 4: an Offer's pieces (`Piece`), an Ack's `pulled`; 5: the model
                   # fingerprint in an Offer, a stream header and `WorkerInfo`; 6: a
                   # handoff's pages padded to `jaxpd.sizes.coarse_ceil`

# Control messages (Offer, Ack, a KV stream header, role RPC bodies) carry a request's
# wire form at most: 2 MiB holds ~400k token ids (up to 5 bytes each in msgpack).
MAX_MESSAGE_BYTES = 2 << 20
_LIMITS = {"max_str_len": 1 << 16,       # ids, addresses, reasons, dtype names
           "max_bin_len": 1 << 16,
           "max_array_len": 1 << 19,     # token ids, per-page checksums
           "max_map_len": 64,            # the widest body has ~15 keys
           "max_ext_len": 0}             # no extension types on this wire


class TransferError(RuntimeError):
    """A handoff could not be moved; the decode side re-prefills or the router retries."""


class WireVersionError(TransferError):
    """The peer speaks another wire-format version: never guess at its bytes."""


class LayoutMismatchError(TransferError):
    """An array's layout differs from the one announced, or cannot be rebuilt here."""


class MalformedMessage(ValueError):
    """A body that is not one msgpack map within the size and container limits: the
    server answers INVALID_ARGUMENT."""


def pack(message: dict[str, Any]) -> bytes:
    """A msgpack body (bytes stay bytes, str stays str); `wire_version`, if present,
    goes first so the receiver checks it before decoding the rest."""
    if "wire_version" in message:
        message = {"wire_version": message["wire_version"], **message}
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES, where: str = "message") -> Any:
    """The inverse of `pack`, bounded like `unpack_checked` but without its version
    and shape checks (for replies, whose caller checks them). Raises `MalformedMessage`."""
    _check_size(data, max_bytes, where)
    try:
        return msgpack.unpackb(data, raw=False, **_LIMITS)
    except Exception as e:  # noqa: BLE001 -- msgpack raises several unrelated types
        raise MalformedMessage(f"{where}: not msgpack within limits: "
                               f"{type(e).__name__}: {e}") from None


def unpack_checked(data: bytes, where: str, max_bytes: int = MAX_MESSAGE_BYTES
                   ) -> dict[str, Any]:
    """A peer's control message as a map, or an error that costs little to reach:
    `MalformedMessage` for a body over `max_bytes` (before decoding), one that is not
    a single msgpack map with str keys, or one past a container limit;
    `WireVersionError` for a `wire_version` other than this build's (read from the
    first few bytes, before the body is decoded, when it comes first as `pack` puts
    it), or none."""
    _check_size(data, max_bytes, where)
    first = _first_entry(data)
    if first is not None and first[0] == "wire_version":
        check_wire_version(first[1], where)
    message = unpack(data, max_bytes, where)
    if not isinstance(message, dict):
        raise MalformedMessage(f"{where}: expected a map, got {type(message).__name__}")
    if not all(isinstance(k, str) for k in message):
        raise MalformedMessage(f"{where}: every key must be a str")
    check_wire_version(message.get("wire_version"), where)
    return message


def _first_entry(data: bytes) -> tuple[Any, Any] | None:
    """The first key and value of a msgpack map, decoded from its first bytes only;
    None if they are not there (the full decode then says what is wrong)."""
    head = msgpack.Unpacker(raw=False, read_size=64, max_buffer_size=64, **_LIMITS)
    head.feed(bytes(data[:64]))
    try:
        if head.read_map_header() < 1:
            return None
        return head.unpack(), head.unpack()
    except Exception:  # noqa: BLE001 -- not a map, or a first entry longer than 64 bytes
        return None


def _check_size(data: Any, max_bytes: int, where: str) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"{where}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MalformedMessage(f"{where}: {len(data)} bytes, more than the {max_bytes} "
                               f"a control message may have")


def check_wire_version(received: Any, where: str) -> None:
    """Raise `WireVersionError` unless `received` is this build's `WIRE_VERSION`."""
    if received != WIRE_VERSION or isinstance(received, bool):
        raise WireVersionError(
            f"{where}: peer sent wire version {received!r}, this side speaks "
            f"{WIRE_VERSION}; run the same jaxpd version on prefill and decode")
