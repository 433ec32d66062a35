"""Schedulers (plain Python, no jax): they decide, the engine executes.

`PrefillScheduler` groups waiting requests by padded length bucket and returns a
`PrefillBatch` plan; `DecodeScheduler` owns the decode slots and each shard's page
allocator and returns a `StepPlan` for every decode step.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

from jaxpd.engine.scheduling.buckets import batch_buckets
from jaxpd.engine.scheduling.page_allocator import (CacheJournal, PageAllocator, page_hashes,
                                                   pages_for)
from jaxpd.request import Request


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    requests: list[Request]
    batch_size: int      # padded B
    length: int          # padded T (the bucket)
    chunked: bool = False  # one prompt longer than every bucket, prefilled in chunks


class PrefillScheduler:
    """Length-bucketed, oldest-first prefill batching.

    A bucket runs when its batch is full, or when its oldest request has waited
    `bucket_timeout_s`. Buckets are visited in the order of their oldest request, so
    the oldest request anywhere runs at most one timeout (plus the running batch)
    after arrival: no starvation. Below `min_batch` after the timeout, requests of
    shorter buckets may ride along, padded to this bucket.

    `chunked`: a request longer than the largest bucket waits in a lane of its own and
    leaves alone, as a `PrefillBatch` with `chunked` set, in its turn by age like a
    bucket; `schedule(long_ok=False)` holds that lane while one is still being
    prefilled chunk by chunk. Without it such a request is refused by `add`.
    """

    def __init__(self, buckets: list[int], max_batch: int, max_tokens: int,
                 bucket_timeout_s: float = 0.005, min_batch: int = 1, chunked: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_prefill_batch must be >= 1, got {max_batch}")
        if max_tokens < buckets[-1]:
            raise ValueError(f"max_prefill_tokens={max_tokens} is smaller than the largest "
                             f"bucket {buckets[-1]}: a longest prompt could never run")
        self.buckets = list(buckets)
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.bucket_timeout_s = bucket_timeout_s
        self.min_batch = min_batch
        self.batch_sizes = batch_buckets(max_batch)
        self._waiting: dict[int, collections.deque[Request]] = {b: collections.deque() for b in buckets}
        self.chunked = chunked
        self._long: collections.deque[Request] = collections.deque()

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if num_tokens <= b:
                return b
        raise ValueError(f"prompt of {num_tokens} tokens is longer than the largest "
                         f"prefill bucket {self.buckets[-1]}")

    def add(self, request: Request) -> None:
        if self.chunked and request.num_tokens > self.buckets[-1]:
            self._long.append(request)
            return
        self._waiting[self.bucket_for(request.num_tokens)].append(request)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues())

    def _queues(self) -> list[collections.deque[Request]]:
        return [*self._waiting.values(), self._long]

    def drop_final(self) -> list[Request]:
        """Remove requests that were aborted while waiting; returns them."""
        dropped = []
        for q in self._queues():
            keep = [r for r in q if not r.is_final]
            dropped += [r for r in q if r.is_final]
            q.clear()
            q.extend(keep)
        return dropped

    def take_all(self) -> list[Request]:
        """Every waiting request, oldest first; the scheduler is left empty (an elastic
        re-split hands them to the new prefill mesh's scheduler)."""
        taken = sorted((r for q in self._queues() for r in q), key=lambda r: r.timings.arrival)
        for q in self._queues():
            q.clear()
        return taken

    def batch_cap(self, bucket: int) -> int:
        """Rows of a batch in `bucket`: the batch and token limits."""
        return max(1, min(self.max_batch, self.max_tokens // bucket))

    def padded_batch(self, n: int, bucket: int) -> int:
        cap = self.batch_cap(bucket)
        return min(next(s for s in self.batch_sizes if s >= n), cap) if n <= cap else cap

    def schedule(self, now: float, long_ok: bool = True
                 ) -> tuple[PrefillBatch | None, float | None]:
        """The batch to run now, or (None, seconds until one may become due). A long
        request (`chunked`) is due at once in its turn; `long_ok` False passes it by."""
        self.drop_final()
        order = sorted((q[0].timings.arrival, b) for b, q in self._waiting.items() if q)
        if self._long and long_ok:
            oldest = self._long[0].timings.arrival
            if not order or oldest <= order[0][0] or all(
                    len(self._waiting[b]) < self.batch_cap(b) and now - t < self.bucket_timeout_s
                    for t, b in order):
                r = self._long.popleft()
                return PrefillBatch([r], 1, self.buckets[-1], chunked=True), 0.0
        if not order:
            return None, None
        for oldest, bucket in order:
            queue = self._waiting[bucket]
            cap = self.batch_cap(bucket)
            if len(queue) >= cap or now - oldest >= self.bucket_timeout_s:
                return self._take(bucket, cap), 0.0
        return None, max(0.0, order[0][0] + self.bucket_timeout_s - now)

    def _take(self, bucket: int, cap: int) -> PrefillBatch:
        queue = self._waiting[bucket]
        taken = [queue.popleft() for _ in range(min(cap, len(queue)))]
        if len(taken) < min(self.min_batch, cap):
            # Mix in the oldest shorter requests; they fit this bucket's padding.
            shorter = sorted((r.timings.arrival, b) for b in self.buckets if b < bucket
                             for r in self._waiting[b])
            for _, b in shorter:
                if len(taken) >= min(self.min_batch, cap):
                    break
                taken.append(self._waiting[b].popleft())
        return PrefillBatch(taken, self.padded_batch(len(taken), bucket), bucket)


@dataclasses.dataclass
class Slot:
    request: Request
    pages: list[int]
    position: int          # where the next fed token goes (== tokens with KV so far)
    ready: bool = True     # False while its KV is still being transferred in
    num_shared: int = 0    # leading pages shared from the prefix cache (never written)


@dataclasses.dataclass(frozen=True)
class StepEntry:
    slot: int              # global slot index (shard * slots_per_shard + local)
    request: Request
    position: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    entries: list[StepEntry]
    preempted: list[Request]
    max_pages: int         # most pages any stepped slot uses (for the context bucket)


class DecodeScheduler:
    """Slots and pages of every dp shard. A slot's pages grow one page at a time as its
    position crosses a page boundary; when a shard runs out, its youngest request is
    preempted (pages freed, request handed back for recompute).

    `prefix_root` (None: no prefix cache) roots the page hashes (`page_hashes`): a
    slot's full pages are published when its KV is in place and when it is released,
    and `find_slot` prefers the shard holding the longest cached prefix of a request,
    whose pages `admit` then shares instead of allocating. `on_evict(shard, pairs)`:
    each shard's allocator tells it the (page, hash) pairs it evicts (`PageAllocator`)."""

    def __init__(self, num_shards: int, slots_per_shard: int, pages_per_shard: int,
                 page_size: int, prefix_root: bytes | None = None,
                 journal: CacheJournal | None = None,
                 on_evict: Callable[[int, list[tuple[int, bytes]]], None] | None = None):
        self.num_shards = num_shards
        self.slots_per_shard = slots_per_shard
        self.page_size = page_size
        self.prefix_root = prefix_root
        self.allocators = [
            PageAllocator(pages_per_shard, journal,
                          None if on_evict is None else functools.partial(on_evict, shard))
            for shard in range(num_shards)]
        self.slots: list[Slot | None] = [None] * (num_shards * slots_per_shard)

    @property
    def caching(self) -> bool:
        return self.prefix_root is not None

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    def pages_needed(self, num_tokens: int) -> int:
        # The prompt's pages plus room for the first fed token at position num_tokens.
        return pages_for(num_tokens + 1, self.page_size)

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        return page_hashes(token_ids, self.page_size, self.prefix_root) if self.caching else []

    def find_slot(self, num_tokens: int, token_ids: list[int] | None = None,
                  max_shared: int | None = None, min_shared: int = 0
                  ) -> tuple[int, list[int]] | None:
        """A free slot for a request whose first `num_tokens` tokens (`token_ids`) need
        KV, and the cached pages it can share there (at most `max_shared`, default every
        full page; at least `min_shared`): the shard with the longest cached prefix, then
        the most free pages, that can hold the rest. None if no shard can now."""
        hashes = self.hashes(token_ids[:num_tokens]) if token_ids is not None else []
        if max_shared is not None:
            hashes = hashes[:max_shared]
        best, best_key = None, None
        for shard, alloc in enumerate(self.allocators):
            base = shard * self.slots_per_shard
            free = [i for i in range(base, base + self.slots_per_shard) if self.slots[i] is None]
            if not free:
                continue
            shared = alloc.cached_prefix(hashes)
            if len(shared) < min_shared:
                continue
            # Shared pages sitting unreferenced in the LRU stop being allocatable.
            in_lru = sum(alloc.refs(p) == 0 for p in shared)
            if alloc.num_free - in_lru < self.pages_needed(num_tokens) - len(shared):
                continue
            key = (len(shared), alloc.num_free)
            if best_key is None or key > best_key:
                best, best_key = (free[0], shared), key
        return best

    def holds_prefix(self, token_ids: list[int], num_pages: int) -> bool:
        """Whether some shard holds the first `num_pages` full pages of `token_ids`
        cached (in use or not)."""
        hashes = self.hashes(token_ids)[:num_pages]
        return len(hashes) == num_pages and any(
            len(a.cached_prefix(hashes)) == num_pages for a in self.allocators)

    def admit(self, slot: int, request: Request, num_tokens: int, ready: bool = True,
              shared: list[int] = ()) -> list[int]:
        """Occupy `slot` for a request whose first `num_tokens` have KV; returns its pages
        (the `shared` cached ones first, then its own). A slot admitted not `ready` (KV
        still in transfer or being computed) is neither stepped nor preempted until
        `mark_ready`."""
        assert self.slots[slot] is None, f"slot {slot} is taken"
        alloc = self.allocators[self.shard_of(slot)]
        alloc.share(list(shared))
        pages = list(shared) + alloc.allocate(self.pages_needed(num_tokens) - len(shared))
        self.slots[slot] = Slot(request, pages, num_tokens, ready, len(shared))
        self.publish(slot)
        return pages

    def mark_ready(self, slot: int) -> None:
        self.slots[slot].ready = True
        self.publish(slot)

    def publish(self, slot: int) -> int:
        """Publish the slot's full pages whose KV is written (a ready slot's tokens below
        its position); returns how many are now findable."""
        s = self.slots[slot]
        if not self.caching or s is None or not s.ready:
            return 0
        ids = s.request.prefill_ids[:s.position]
        alloc = self.allocators[self.shard_of(slot)]
        return sum(alloc.publish(p, h) for p, h in zip(s.pages, self.hashes(ids)))

    def release(self, slot: int) -> None:
        state = self.slots[slot]
        if state is not None:
            self.publish(slot)
            self.allocators[self.shard_of(slot)].free(state.pages)
            self.slots[slot] = None

    def slot_of(self, request: Request) -> int | None:
        for i, s in enumerate(self.slots):
            if s is not None and s.request is request:
                return i
        return None

    def plan_step(self) -> StepPlan:
        """Make sure every active slot has the page its next write needs (preempting the
        youngest request of a shard that ran out), then list what to step."""
        preempted: list[Request] = []
        for i, s in enumerate(self.slots):
            while s is not None and s.ready and \
                    len(s.pages) < pages_for(s.position + 1, self.page_size):
                alloc = self.allocators[self.shard_of(i)]
                if alloc.can_allocate(1):
                    s.pages += alloc.allocate(1)
                    continue
                victim = self._youngest(self.shard_of(i))
                preempted.append(self.slots[victim].request)
                self.release(victim)
                s = self.slots[i]
        entries = [StepEntry(i, s.request, s.position) for i, s in enumerate(self.slots)
                   if s and s.ready]
        max_pages = max((len(self.slots[e.slot].pages) for e in entries), default=1)
        return StepPlan(entries, preempted, max_pages)

    def advance(self, plan: StepPlan) -> None:
        for e in plan.entries:
            s = self.slots[e.slot]
            if s is not None and s.request is e.request:
                s.position += 1

    def _youngest(self, shard: int) -> int:
        base = shard * self.slots_per_shard
        # Never a slot whose KV is still arriving: its pages are being written.
        occupied = [i for i in range(base, base + self.slots_per_shard)
                    if self.slots[i] and self.slots[i].ready]
        return max(occupied, key=lambda i: self.slots[i].request.timings.arrival)
