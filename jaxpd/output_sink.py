"""Where a request's outputs go: a sink its consumer chooses before submitting it.

The thread that changes a request (an engine loop, the router's relay) puts each event
-- (new token ids, finish reason or None) -- into `Request.events` while it holds the
request's lock, so `put` never blocks and never calls back into the request. Sinks:

- `EventQueue`: one request's events in a blocking queue, for whoever has a thread to
  wait on anyway (the library's `LLM.generate` / `stream`);
- `MergedEvents`: the events of several requests (one caller's `n` samples) in one
  blocking queue, tagged with the request's index: one waiting thread for all of them;
- `AsyncOutputs`: the events of several requests for an asyncio event loop (the HTTP
  and gRPC servers, the router's relay, a role worker's calls). `put` appends to the request's deque and, at
  most once until the loop has run it, schedules a wake-up with
  `loop.call_soon_threadsafe`; the consumer awaits `get`. No thread per request, no
  polling interval.

`max_buffered` bounds the events a reader has not taken yet: `put` past it still keeps
the event and answers False, and the request then aborts itself with `SLOW_READER` (its
final event is the only one past the bound), so a reader that stops reading costs the
engine at most that many events and frees its slot and pages at once.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
from typing import Protocol

Event = tuple[list[int], "str | None"]     # (new token ids, finish reason or None)
SLOW_READER = "slow reader: the stream's output buffer is full"
# The servers' bound on one stream's unread events: far more than a reader that keeps
# up ever holds (the engine puts one event per token per step), and a few hundred KB.
MAX_BUFFERED = 4096


class OutputSink(Protocol):
    def put(self, event: Event) -> bool:
        """Keep `event` without blocking; False when the reader is past its bound."""


def _check_bound(max_buffered: int | None) -> None:
    if max_buffered is not None and max_buffered < 1:
        raise ValueError(f"max_buffered must be >= 1 or None, got {max_buffered}")


class EventQueue:
    """One request's events, read by a blocking `get` (queue.Empty on a timeout)."""

    def __init__(self, max_buffered: int | None = None):
        _check_bound(max_buffered)
        self.max_buffered = max_buffered
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, event: Event) -> bool:
        self._queue.put(event)
        return self.max_buffered is None or self._queue.qsize() <= self.max_buffered

    def get(self, timeout: float | None = None) -> Event:
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> Event:
        return self._queue.get_nowait()

    def empty(self) -> bool:
        return self._queue.empty()


class _Tagged:
    """The sink of request `index` of a `MergedEvents`."""

    def __init__(self, merged: MergedEvents, index: int):
        self._merged, self._index = merged, index

    def put(self, event: Event) -> bool:
        return self._merged.put(self._index, event)


class MergedEvents:
    """The events of `n` requests as (index, event), in the order they were put; give
    request i `sinks[i]` before it is submitted."""

    def __init__(self, n: int, max_buffered: int | None = None):
        _check_bound(max_buffered)
        self.max_buffered = max_buffered
        self.sinks = [_Tagged(self, i) for i in range(n)]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._unread = [0] * n

    def put(self, index: int, event: Event) -> bool:
        with self._lock:
            self._unread[index] += 1
            within = self.max_buffered is None or self._unread[index] <= self.max_buffered
        self._queue.put((index, event))
        return within

    def get(self) -> tuple[int, Event]:
        index, event = self._queue.get()
        with self._lock:
            self._unread[index] -= 1
        return index, event


class _Deque:
    """The sink of request `index` of an `AsyncOutputs`."""

    def __init__(self, outputs: AsyncOutputs):
        self._outputs = outputs
        self.items: collections.deque = collections.deque()

    def put(self, event: Event) -> bool:
        self.items.append(event)
        self._outputs.wake()
        bound = self._outputs.max_buffered
        return bound is None or len(self.items) <= bound


class AsyncOutputs:
    """The events of `n` requests for the event loop `loop`: give request i `sinks[i]`
    before it is submitted, and `await get()` on the loop. `put` may run on any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1,
                 max_buffered: int | None = None):
        _check_bound(max_buffered)
        self.max_buffered = max_buffered
        self._loop = loop
        self.sinks = [_Deque(self) for _ in range(n)]
        self._ready = asyncio.Event()
        self._wake_scheduled = False
        self._next = 0

    def wake(self) -> None:
        """Have the loop look at the deques (at most one call in flight: a burst of
        events from the engine's step costs the loop one wake-up)."""
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        with contextlib.suppress(RuntimeError):     # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._on_wake)

    def _on_wake(self) -> None:
        # Cleared before the consumer looks again: an event put after this line
        # schedules a wake-up of its own, one put before it is seen by that look.
        self._wake_scheduled = False
        self._ready.set()

    def get_nowait(self) -> tuple[int, Event] | None:
        """The next event of any request (taking turns between them), or None."""
        n = len(self.sinks)
        for k in range(n):
            i = (self._next + k) % n
            if self.sinks[i].items:
                self._next = (i + 1) % n
                return i, self.sinks[i].items.popleft()
        return None

    async def get(self) -> tuple[int, Event]:
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            self._ready.clear()
            item = self.get_nowait()
            if item is not None:
                return item
            await self._ready.wait()
