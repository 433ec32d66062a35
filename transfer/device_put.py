"""In-process transfer: `jax.device_put` from the prefill mesh onto a decode shard."""
from __future__ import annotations

import queue
import time

import jax

from jaxpd.transfer.connector import KVHandoff, TransferStats, next_or_none


class DevicePutConnector:
    """Prefill and decode in one process; a bounded queue is the control plane.

    The bound gives backpressure: a prefill worker that outruns decode blocks in
    `send` instead of piling KV on the prefill devices.
    """

    def __init__(self, max_pending: int = 64):
        self._queue: queue.Queue[KVHandoff] = queue.Queue(maxsize=max_pending)
        self._closed = False

    def send(self, handoff: KVHandoff) -> None:
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
