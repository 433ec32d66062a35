"""The `Connector` protocol: how a finished prefill's KV pages reach the decode side.

The prefill side calls `send(handoff)`; the decode side calls `receive(timeout)` to
get the next handoff (the control plane: metadata, pages possibly still remote),
then `place(handoff, sharding)` to materialise the pages on the devices of the decode
shard that owns the request's slot (the data plane). Splitting the two lets the
decode side allocate its slot and pages *before* the bytes move.
"""
from __future__ import annotations

import dataclasses
import queue
from typing import Any, Protocol

import jax


class TransferError(RuntimeError):
    """A handoff could not be moved; the decode side re-prefills or the router retries."""


class WireVersionError(TransferError):
    """The peer speaks another wire-format version: never guess at its bytes."""


class LayoutMismatchError(TransferError):
    """An array's layout differs from the one announced, or cannot be rebuilt here."""


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """What one transfer cost: bytes actually moved and wall time of the move."""
    num_bytes: int
    seconds: float


@dataclasses.dataclass
class KVHandoff:
    """A finished prefill on its way to decode.

    k, v: [L, P, S, K, H] -- only the pages that hold real prompt tokens
    (P = ceil(num_tokens / S)), never the bucket padding.
    `payload` carries the request: the `Request` object itself in one process, its
    msgpack-able wire form (`jaxpd.request.Request.to_wire`) across processes.
    """
    request_id: str
    num_tokens: int
    first_token: int
    k: jax.Array
    v: jax.Array
    payload: Any = None
    # Which decode peer gets it (a cross-process connector's address for that peer);
    # None: the connector's default. In one process there is only one.
    destination: str | None = None

    @property
    def num_pages(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_bytes(self) -> int:
        return int(self.k.nbytes) + int(self.v.nbytes)


def next_or_none(q: "queue.Queue[KVHandoff]", timeout: float | None) -> KVHandoff | None:
    """`receive` semantics over a queue: wait up to `timeout` s (None or 0: not at all)."""
    try:
        return q.get(timeout=timeout) if timeout else q.get_nowait()
    except queue.Empty:
        return None


class Connector(Protocol):
    """Moves KV pages from prefill to decode."""

    def send(self, handoff: KVHandoff) -> None:
        """Prefill side: hand over a finished prefill. May block for backpressure."""

    def receive(self, timeout: float | None) -> KVHandoff | None:
        """Decode side: the next handoff, or None after `timeout` seconds; with
        `timeout=None` it does not wait at all."""

    def place(self, handoff: KVHandoff,
              sharding: jax.sharding.Sharding) -> tuple[jax.Array, jax.Array, TransferStats]:
        """Decode side: the handoff's (k, v) pages on `sharding`, and what it cost.
        Raises `TransferError` when the pages cannot be had: the caller re-prefills."""

    def discard(self, handoff: KVHandoff) -> None:
        """Decode side: this handoff will never be placed (its request was cancelled, or
        a newer prefill of it superseded it): let the sender free its pages now."""

    def close(self) -> None:
        """Release queues, servers and threads."""
