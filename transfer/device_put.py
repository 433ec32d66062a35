"""In-process transfer: `jax.device_put` from the prefill mesh onto a decode shard.

Why `send` stages the pages on the decode mesh at once: left to `place` (called on a
`jaxpd-transfer` thread once the decode loop has a slot for the request), the copy is
issued after the prefill loop may have dispatched its next batch, and whether it then
waits behind that batch is up to the runtime's ordering: the request's second token
then waits for a whole prefill batch. Staging makes the order ours: the engine gives
the connector a staging sharding on the decode mesh (`stage_on`: dp shard 0's page
layout), and `send` issues `jax.device_put(pages, staging)` before it returns, i.e.
before the prefill loop can dispatch anything else; the copy runs asynchronously.
`place` then moves staging -> the request's shard on decode devices only (nothing to
do when the request lands on shard 0, which is every request on `decode=1`).

What it costs: staged pages live on decode shard 0 until placed, where they used to
live on the prefill devices; they are the same pages, bounded the same way (this
queue's `max_pending`, plus handoffs the decode loop has received and not yet
admitted). Layer-wise parts are staged one by one as they are sent, so a group's copy
still overlaps the next group's compute. Compressed transfer wraps this sender, so
the packed bytes are what is staged (the engine passes their replicated layout).
`place`'s `TransferStats.seconds` covers only what is left to move when it runs.
"""
from __future__ import annotations

import dataclasses
import queue
import time

import jax

from jaxpd.transfer.connector import KVHandoff, TransferStats, next_or_none


class DevicePutConnector:
    """Prefill and decode in one process; a bounded queue is the control plane.

    The bound gives backpressure: a prefill worker that outruns decode blocks in
    `send` instead of piling up KV. `stage=False` leaves the pages on the prefill
    devices until `place` (the behaviour before staging; for comparisons).
    """

    def __init__(self, max_pending: int = 64, stage: bool = True):
        self._queue: queue.Queue[KVHandoff] = queue.Queue(maxsize=max_pending)
        self._closed = False
        self.stage = stage
        self._staging: jax.sharding.Sharding | None = None

    def stage_on(self, sharding: jax.sharding.Sharding | None) -> None:
        """Where `send` copies each handoff's pages (decode devices, in the layout the
        pages travel in); None: nowhere. A no-op when built with `stage=False`."""
        self._staging = sharding if self.stage else None

    def send(self, handoff: KVHandoff) -> None:
        if self._staging is not None:
            # Issued now, before the prefill loop dispatches its next program.
            k, v = jax.device_put((handoff.k, handoff.v), self._staging)
            handoff = dataclasses.replace(handoff, k=k, v=v)
        while True:
            if self._closed:
                raise RuntimeError("DevicePutConnector is closed")
            try:
                self._queue.put(handoff, timeout=0.1)
                return
            except queue.Full:
                continue

    def receive(self, timeout: float | None) -> KVHandoff | None:
        return next_or_none(self._queue, timeout)

    def pending(self) -> int:
        return self._queue.qsize()

    def place(self, handoff: KVHandoff, sharding: jax.sharding.Sharding):
        start = time.perf_counter()
        k, v = jax.device_put((handoff.k, handoff.v), sharding)
        jax.block_until_ready((k, v))
        return k, v, TransferStats(handoff.num_bytes, time.perf_counter() - start)

    def discard(self, handoff: KVHandoff) -> None:
        """Nothing to do: the pages go with the last reference to the handoff."""

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._closed = True
