"""`ExtendLoop`: prefill with context on the decode mesh (prefix caching).

With a prefix cache, a request that the decode mesh prefills itself (colocated
serving, a decode-only process, or a prompt whose uncached part is short) is admitted
into a slot *first*: the cached pages of its longest prefix on the best shard are
shared into its block table (`DecodeScheduler.find_slot`/`admit`), and one jitted
program (`DecodeRunner.extend`) computes only the rest of its tokens, writing their
K/V straight into the slot's own pages while attending to the shared ones. Nothing is
transferred or inserted, the compute saved is the prefix, and the slot is ready for
the next decode step with the first token sampled.

It owns no thread: the decode loop calls `run_once` between steps, on the thread that
alone touches the pool. Batches are FIFO: the oldest request that finds no slot yet
holds the others back, as handoffs do in `DecodeLoop._admit`.

**Chunks** (`chunk_tokens`, colocated serving's `chunked_prefill_tokens`): a call
computes at most that many padded tokens, and a request with more to compute takes
that many per call, each chunk attending to the pages the chunks before it wrote into
its slot. Its slot and pages are reserved for the whole prompt at admission; between
two chunks the decode loop runs a step for every other slot, so a long prompt delays a
running stream by one chunk, not by its whole prefill. Requests part-way through are
continued first, oldest first; only the last chunk samples.
"""
from __future__ import annotations

import collections
import queue
import time
from typing import Callable

import jax
import numpy as np

import dataclasses

from jaxpd.engine.kv.host_tier import HostTier
from jaxpd.engine.programs.decode_runner import DecodeRunner
from jaxpd.engine.programs.sampler import SamplingArrays
from jaxpd.engine.scheduling.buckets import batch_buckets
from jaxpd.engine.scheduling.scheduler import DecodeScheduler
from jaxpd.request import Request, State
from jaxpd.stats import StatsCounter


@dataclasses.dataclass
class _Row:
    """One request's share of a call: tokens [start, start + count) into `slot`."""
    slot: int
    request: Request
    start: int
    count: int

    @property
    def final(self) -> bool:
        return self.start + self.count == self.request.num_tokens


class ExtendLoop:
    """`buckets`: padded new-token lengths (the engine's prefill buckets);
    `max_batch` requests per dp shard and `max_tokens` padded tokens per call;
    `expected_below`: requests come with fewer new tokens than this (a mesh with a
    prefill mesh beside it sends only short rests here), so warm-up compiles only
    their buckets; None: any length (colocated, or a decode-only process).
    `expects_fresh`: requests may come with nothing cached (else warm-up compiles only
    programs with a prefix). `chunk_tokens`: a request computes at most this many
    tokens per call (a bucket; `max_tokens` is then at most it), None: all at once.
    `host`: the pool's host tier, whose pages a request's prefix may continue in.
    `reroute`: where a request goes whose call would need a program still compiling
    in the background (the prefill mesh beside a `lazy` loop; see `_admit`).
    `prefix_in_place`: the runner reads each row's real prefix in place whatever its
    table's width (`DecodeRunner.extend_kernel` "native"), so every prefix takes one
    width, the slot's: a program per (rows, length), not per width too."""

    def __init__(self, runner: DecodeRunner, scheduler: DecodeScheduler,
                 inbox: queue.SimpleQueue, stats: StatsCounter, buckets: list[int],
                 max_batch: int, max_tokens: int, max_pages_per_slot: int, context_step: int,
                 expected_below: int | None = None,
                 expects_fresh: bool = True, chunk_tokens: int | None = None,
                 host: HostTier | None = None,
                 reroute: Callable[[Request], None] | None = None,
                 prefix_in_place: bool = False):
        self.runner, self.scheduler, self.inbox, self.stats = runner, scheduler, inbox, stats
        self.prefix_in_place = prefix_in_place
        self.host, self.reroute = host, reroute
        if chunk_tokens is not None:
            if chunk_tokens not in buckets:
                raise ValueError(f"chunk_tokens={chunk_tokens} is not a bucket of {buckets}")
            buckets = [b for b in buckets if b <= chunk_tokens]
            max_tokens = min(max_tokens, chunk_tokens)
        self.chunk_tokens = chunk_tokens
        self.buckets, self.batch_sizes = buckets, batch_buckets(max_batch)
        # (A rest longer than expected, its prefix evicted since it was routed, runs
        # in a bucket compiled on first use.)
        self.warm_buckets = buckets if expected_below is None else \
            [b for b in buckets if b < expected_below or b == self.bucket_for(expected_below)]
        # Beside a prefill mesh, programs with a prefix compile on demand in the
        # background (`ready_for`), and a request waits for them on the prefill mesh.
        self.lazy = expected_below is not None
        self.expected_below = expected_below
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.max_pages_per_slot, self.context_step = max_pages_per_slot, context_step
        self.expects_fresh = expects_fresh
        self.waiting: collections.deque[Request] = collections.deque()
        # Requests part-way through their chunks, oldest first: (row of the next chunk
        # but for its count, the slot object it was admitted into).
        self.chunking: collections.deque[tuple[_Row, object]] = collections.deque()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.chunking and self.inbox.empty()

    def width(self, num_pages: int) -> int:
        """Pages of cached prefix a call reads for rows of at most `num_pages` prefix
        pages: none for none, else powers of four times the decode step (the slot's
        pages with `prefix_in_place`: a wider table costs nothing there). Coarse: a
        call's programs are also keyed on rows and length, warm-up compiles every
        combination, and every XLA:CPU program maps a few hundred regions of code (the
        kernel's default limit is 65,530 a process)."""
        if num_pages == 0:
            return 0
        if self.prefix_in_place:
            return self.max_pages_per_slot
        width = self.context_step
        while width < num_pages:
            width *= 4
        return min(width, self.max_pages_per_slot)

    def widths(self, max_pages: int) -> list[int]:
        """Every width `width` can return for prefixes of up to `max_pages` pages (none
        included only if `expects_fresh`)."""
        return sorted({self.width(n) for n in range(0 if self.expects_fresh else 1,
                                                    max_pages + 1)})

    def max_prefix_pages(self, length: int) -> int:
        """Most cached pages a row computing in the `length` bucket can have: its
        uncached tokens need this bucket (more than the one below), and the whole
        request fits a slot."""
        below = max([b for b in self.buckets if b < length], default=0)
        page_size = self.scheduler.page_size
        return max(0, (self.max_pages_per_slot * page_size - below - 1) // page_size)

    def rows_for(self, length: int) -> list[int]:
        """The row counts a call of `length` new tokens can have (the token budget)."""
        shards = self.scheduler.num_shards
        return [shards * b for b in self.batch_sizes
                if shards * b * length <= self.max_tokens] or [shards]

    def ready_for(self, new_tokens: int, cached_tokens: int) -> bool:
        """Whether a request of `new_tokens` after `cached_tokens` cached would run on
        compiled programs here (every row count of its shape); if not, they are asked
        for in the background (`DecodeRunner.extend_ready`) and it goes elsewhere."""
        length = self.bucket_for(new_tokens)
        width = self.width(cached_tokens // self.scheduler.page_size)
        return all([self.runner.extend_ready(rows, length, width)
                    for rows in self.rows_for(length)])

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if num_tokens <= b)

    def run_once(self) -> list[tuple[int, Request, int]]:
        """Compute one call: the next chunks of requests part-way through, then the
        oldest waiting requests that fit a slot and the call's limits. Returns the
        slots whose KV is now complete, as (slot, request, first token), for the decode
        loop to take (`DecodeLoop.take_ready`)."""
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        batch = self._continued()
        batch += self._admit(batch)
        if batch:
            return self._run(batch)
        if self.lazy:
            self._prime()
        return []

    def _prime(self) -> None:
        """Run once one program compiled in the background that never ran
        (`DecodeRunner.prime_extend`): one a request asked for, or any while no slot
        decodes, so that a first run, slower than the later ones, delays no stream but
        for a program traffic needs."""
        shapes = self.runner.unprimed_extends()
        if shapes and (self.runner.prime_asked(*shapes[0]) or
                       self.scheduler.num_active() == 0):
            self.runner.prime_extend(*shapes[0])

    def _count(self, request: Request, start: int) -> int:
        rest = request.num_tokens - start
        return rest if self.chunk_tokens is None else min(rest, self.chunk_tokens)

    def _fits(self, batch: list[_Row], row: _Row) -> bool:
        """Whether `row` joins `batch` within a shard's rows and the padded tokens."""
        per_shard = collections.Counter(self.scheduler.shard_of(r.slot) for r in batch)
        per_shard[self.scheduler.shard_of(row.slot)] += 1
        if max(per_shard.values()) > self.max_batch:
            return False
        rows = self.scheduler.num_shards * self._padded(max(per_shard.values()))
        return not batch or rows * self.bucket_for(max(r.count for r in batch + [row])) \
            <= self.max_tokens

    def _continued(self) -> list[_Row]:
        """The next chunk of each request part-way through that still holds its slot
        (one aborted or preempted meanwhile is dropped: its slot was released)."""
        batch: list[_Row] = []
        for _ in range(len(self.chunking)):
            row, held = self.chunking.popleft()
            if self.scheduler.slots[row.slot] is not held or row.request.is_final:
                continue
            row.count = self._count(row.request, row.start)
            if self._fits(batch, row):
                batch.append(row)
            else:
                self.chunking.append((row, held))
        return batch

    def _admit(self, batch: list[_Row]) -> list[_Row]:
        """Rows for the oldest waiting requests that fit a slot and the call's limits
        beside `batch`, now PREFILLING with their pages reserved."""
        admitted: list[_Row] = []
        page_size = self.scheduler.page_size
        while self.waiting:
            r = self.waiting[0]
            if r.is_final:
                self.waiting.popleft()
                continue
            n, ids = r.num_tokens, r.prefill_ids
            # At least the last token is computed: its logits give the next token.
            found = self.scheduler.find_slot(n, ids, max_shared=(n - 1) // page_size)
            if found is None:
                break
            slot, shared = found
            restored = self._fetch(ids[:n], len(shared), (n - 1) // page_size)
            cached = (len(shared) + len(restored)) * page_size
            row = _Row(slot, r, cached, self._count(r, cached))
            if not self._fits(batch + admitted, row):
                break
            if not self._compiled(batch + admitted + [row]):
                if batch or admitted:
                    break                      # it leads the next call, alone
                # Its prefix is not what routing saw (evicted meanwhile, or the host
                # tier holds less): its own program is still compiling, or has not
                # run yet. The prefill mesh serves it instead, so no call here compiles
                # or runs a program for the first time.
                self.runner.extend_ready(*self._shape([row]))
                self.waiting.popleft()
                r.kv_skip_pages = 0 if r.kv_skip_missed else len(shared)
                self.stats.add(extend_cold_requests=1)
                self.reroute(r)
                continue
            self.waiting.popleft()
            if not r.transition(State.PREFILLING):
                continue                       # aborted since it was queued
            pages = self.scheduler.admit(slot, r, n, ready=False, shared=shared)
            if restored:
                self.host.restore(self.scheduler.shard_of(slot),
                                  pages[len(shared):len(shared) + len(restored)], restored)
            admitted.append(row)
            self.stats.add(prefix_query_tokens=n, prefix_hit_tokens=len(shared) * page_size,
                           prefix_host_hit_tokens=len(restored) * page_size)
        return admitted

    def _fetch(self, ids: list[int], num_shared: int, max_pages: int) -> list:
        """The checked pages of the host tier that continue a prefix of `num_shared`
        pages in the pool (at most `max_pages` in all), as `HostTier.fetch` gives them."""
        if self.host is None or num_shared >= max_pages:
            return []
        hashes = self.scheduler.hashes(ids)[num_shared:max_pages]
        if not self.host.restorable(hashes[:1]):
            return []
        return self.host.fetch(hashes)

    def _padded(self, n: int) -> int:
        return next(s for s in self.batch_sizes if s >= n)

    def _shape(self, batch: list[_Row]) -> tuple[int, int, int]:
        """The program a call of `batch` runs: (rows, new-token length, prefix width)."""
        per_shard = collections.Counter(self.scheduler.shard_of(row.slot) for row in batch)
        return (self.scheduler.num_shards * self._padded(max(per_shard.values())),
                self.bucket_for(max(row.count for row in batch)),
                self.width(max(row.start for row in batch) // self.scheduler.page_size))

    def _compiled(self, batch: list[_Row]) -> bool:
        """Whether a call of `batch` runs on a compiled program: always unless `lazy`
        (warm-up compiled every one) or nowhere to send a request instead; else a
        program without a prefix of a warm bucket, or one compiled in the background
        that has run once (`_prime`)."""
        if not self.lazy or self.reroute is None:
            return True
        rows, length, width = self._shape(batch)
        if width == 0 and self.expects_fresh and length in self.warm_buckets:
            return True
        return self.runner.extend_compiled(rows, length, width)

    def _run(self, batch: list[_Row]) -> list[tuple[int, Request, int]]:
        sched = self.scheduler
        rows, length, width = self._shape(batch)
        r_pad = rows // sched.num_shards
        page_size = sched.page_size
        tokens = np.zeros((rows, length), np.int32)
        starts = np.zeros(rows, np.int32)
        lengths = np.ones(rows, np.int32)      # padding rows: one token, to the null page
        prefix_tables = np.zeros((rows, width), np.int32)
        new_tables = np.zeros((rows, -(-length // page_size)), np.int32)
        row_slots = np.zeros(rows, np.int32)
        sampling = SamplingArrays.empty(rows)
        placed = collections.Counter()
        index_of = []
        for row in batch:
            r, slot, start, count = row.request, row.slot, row.start, row.count
            shard = sched.shard_of(slot)
            i = shard * r_pad + placed[shard]
            placed[shard] += 1
            tokens[i, :count] = r.prefill_ids[start:start + count]
            starts[i], lengths[i] = start, count
            pages = sched.slots[slot].pages
            prefix_tables[i, :start // page_size] = pages[:start // page_size]
            own = pages[start // page_size:][:-(-count // page_size)]
            new_tables[i, :len(own)] = own     # (a slot may hold pages for what it decodes)
            row_slots[i] = slot % sched.slots_per_shard
            if row.final:                      # earlier chunks' samples are not read
                sampling.set_row(i, r)
                if r.params.has_penalties:
                    self.runner.set_penalties(slot, r.prompt_ids, r.output_ids)
            if r.timings.prefill_start is None:
                r.timings.prefill_start = time.perf_counter()
            r.timings.local_prefill = True
            index_of.append(i)
        computed = sum(row.count for row in batch)
        self.stats.add(prefill_batches=1, prefill_tokens=computed,
                       prefill_computed_tokens=computed, prefill_padded_tokens=tokens.size,
                       local_prefills=sum(row.final for row in batch))
        first, logprobs = self.runner.extend(tokens, starts, lengths, prefix_tables, new_tables,
                                             row_slots, sampling)
        for row in batch:
            if not row.final:
                self.chunking.append((_Row(row.slot, row.request, row.start + row.count, 0),
                                      sched.slots[row.slot]))
        if not any(row.final for row in batch):
            return []                          # the next call queues behind this one
        first = np.asarray(first)
        logprobs = jax.device_get(logprobs) if sampling.wants_logprobs else None
        now = time.perf_counter()
        ready = []
        for row, i in zip(batch, index_of):
            if not row.final:
                continue
            slot, r = row.slot, row.request
            if r.timings.prefill_end is None:
                r.timings.prefill_end = now
            token = int(first[i])
            lp = None if logprobs is None else logprobs.of_row(i, r)
            s = sched.slots[slot]
            if s is None or s.request is not r:
                continue                       # released meanwhile (cannot happen today)
            if r.append_token(token, now, lp):
                self.stats.add(finished=int(r.state is State.FINISHED))
                s.ready = True                 # its KV is written: keep it cached
                sched.release(slot)
                continue
            ready.append((slot, r, token))
        return ready
