"""How a finished prefill's KV pages reach the decode side: `KVSender` and `KVReceiver`.

The prefill side calls `send(handoff)`. The decode side calls `receive(timeout)` to get
the next handoff (the control plane: metadata, pages possibly still remote), then
`place(handoff, sharding)` to materialise the pages on the devices of the decode shard
that owns the request's slot (the data plane). Splitting the two lets the decode side
allocate its slot and pages *before* the bytes move. Across processes the two halves
are separate classes; in one process, `Connector` is both ends of one queue.
"""
from __future__ import annotations

import dataclasses
import queue
from typing import Any, Protocol

import jax

from jaxpd.transfer.wire import (LayoutMismatchError, TransferError,  # noqa: F401 (re-exported)
                                 WireVersionError)


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """What one transfer cost: bytes actually moved and wall time of the move."""
    num_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class KVPart:
    """Which slice of a layer-wise transfer a handoff carries.

    A long prompt's KV leaves the prefill side in `count` parts, one per layer group,
    each sent as soon as its layers are computed, so moving group g overlaps computing
    group g+1. Every part of one prefill shares `stream` (a fresh random id per
    prefill attempt, so a retry's parts never mix with a dead attempt's); part i holds
    layers `[layer_start, layer_start + k.shape[0])`. Only the last part carries the
    first token: it is sampled after the last layer.
    """
    stream: int
    index: int
    count: int
    layer_start: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"part index {self.index} not in [0, {self.count})")
        if self.layer_start < 0:
            raise ValueError(f"layer_start must be >= 0, got {self.layer_start}")

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def to_dict(self) -> dict:
        return {"stream": self.stream, "index": self.index, "count": self.count,
                "layer_start": self.layer_start}

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVPart | None":
        if d is None:
            return None
        return cls(int(d["stream"]), int(d["index"]), int(d["count"]), int(d["layer_start"]))


@dataclasses.dataclass
class KVHandoff:
    """A finished prefill on its way to decode.

    k, v: [L, P, S, K, H] -- the pages that hold real prompt tokens, never the
    bucket padding: pages `first_page` .. ceil(num_tokens / S) - 1 of the request,
    then padding pages up to P = `jaxpd.sizes.coarse_ceil` of their count (at most a
    quarter more), so that cutting them out and writing them into a pool takes one
    program per padded count, a few dozen at most, not one per count. A
    `first_page` above 0 (prefix caching) says the decode side is expected to hold the
    request's leading full pages already, cached by content; it checks that it does
    before it takes the handoff, and prefills the request again when it does not.
    A layer-wise part (`part` set) holds only its layer group, and `first_token` is -1 except on the last part.
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
    part: KVPart | None = None   # None: the whole KV in one handoff (request-level)
    first_page: int = 0          # the request's page that k[:, 0] / v[:, 0] hold
    # The sender's `models.fingerprint`: a decode pool refuses KV of another model.
    # Empty from a sender that names none (in one process both ends share the model).
    fingerprint: str = ""

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


class KVSender(Protocol):
    """The prefill side of a transfer."""

    def send(self, handoff: KVHandoff) -> None:
        """Hand over a finished prefill (or one layer-wise part of it). May block for
        backpressure; raises `TransferError` when the decode side cannot take it."""

    def counts(self) -> dict[str, int]:
        """Event counts for `EngineStats` (names of its fields), e.g. offers reclaimed."""

    def close(self) -> None:
        """Release queues, servers and threads."""

    # Optional: `wait_pulled(timeout) -> int`, for a sender whose peer pulls the pages
    # from this process later (the transfer server): wait for the pulls of what was
    # sent so far, so the next prefill batch does not hold them up; returns how many
    # still wait. The prefill loop calls it, when present, before each batch.


class KVReceiver(Protocol):
    """The decode side of a transfer: the control plane (`receive`: metadata, pages
    possibly still remote) apart from the data plane (`place`), so that a slot and its
    pages are reserved before the bytes move. `transfer.inbound` builds on these."""

    def receive(self, timeout: float | None) -> KVHandoff | None:
        """The next handoff, or None after `timeout` seconds; with `timeout=None` it
        does not wait at all."""

    def place(self, handoff: KVHandoff,
              sharding: jax.sharding.Sharding) -> tuple[jax.Array, jax.Array, TransferStats]:
        """The handoff's (k, v) pages on `sharding`, and what it cost. Raises
        `TransferError` when the pages cannot be had: the caller re-prefills."""

    def discard(self, handoff: KVHandoff) -> None:
        """This handoff will never be placed (its request was cancelled, or a newer
        prefill of it superseded it): let the sender free its pages now."""

    def counts(self) -> dict[str, int]:
        """Event counts for `EngineStats` (names of its fields), e.g. streams rejected."""

    def close(self) -> None:
        """Release queues, servers and threads."""

    # Optional: `expect_model(fingerprint)`, for a receiver whose bytes arrive before
    # `receive` hands the handoff on (the gRPC stream): the decode pool's model, so it
    # compares a handoff's fingerprint in its control header before it takes any page.


class Connector(KVSender, KVReceiver, Protocol):
    """Both ends in one object: an in-process pipe (`DevicePutConnector`)."""
