"""What every cross-process message shares: msgpack bodies, the wire-format version,
and the errors a transfer can end in.

Plain Python (msgpack, no jax): the router speaks this wire to the role processes
and must not load jax; the transfer modules that move arrays build on it.
"""
from __future__ import annotations

from typing import Any

import msgpack

# Bump on any change to Offer/Ack, the stream header, ArrayLayout's dict form or the
# role RPC bodies.
WIRE_VERSION = 2   # 2: handoffs may be layer-wise parts (`KVPart`)


class TransferError(RuntimeError):
    """A handoff could not be moved; the decode side re-prefills or the router retries."""


class WireVersionError(TransferError):
    """The peer speaks another wire-format version: never guess at its bytes."""


class LayoutMismatchError(TransferError):
    """An array's layout differs from the one announced, or cannot be rebuilt here."""


def pack(message: dict[str, Any]) -> bytes:
    """A msgpack body (bytes stay bytes, str stays str)."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """The inverse of `pack`."""
    return msgpack.unpackb(data, raw=False)


def check_wire_version(received: Any, where: str) -> None:
    """Raise `WireVersionError` unless `received` is this build's `WIRE_VERSION`."""
    if received != WIRE_VERSION:
        raise WireVersionError(
            f"{where}: peer sent wire version {received!r}, this side speaks "
            f"{WIRE_VERSION}; run the same jaxpd version on prefill and decode")
