"""`PrefillLoop`: runs the prefill scheduler's batches and hands each request's KV on.

It owns no thread: the engine calls `run_once` from its `jaxpd-prefill` thread (or,
for the decode mesh's own prefill and for colocated serving, from the thread that also
steps decode). Requests arrive through `inbox` (see `Requests`); their KV leaves
through a `KVSender`, in the form `Requests.payload_of` gives.
"""
from __future__ import annotations

import dataclasses
import queue
import secrets
import time

import jax
import numpy as np

from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.engine.kv.paged_prefill import PrefillCache, chunk_width
from jaxpd.engine.scheduling.registry import Requests
from jaxpd.engine.programs.prefill_runner import PrefillRunner
from jaxpd.engine.programs.sampler import Logprobs, SamplingArrays
from jaxpd.engine.scheduling.scheduler import PrefillBatch, PrefillScheduler
from jaxpd.request import Request, State
from jaxpd.stats import StatsCounter
from jaxpd.transfer.connector import KVHandoff, KVPart, KVSender, TransferError


class PrefillLoop:
    """Prefill batches on one mesh.

    `on_decode_mesh`: this is the decode mesh's own prefill (short prompts, re-prefills
    in a decode-only process), counted apart as local prefills.
    `handoff_wait_s`: with a sender whose peer pulls the pages from this process
    (`wait_pulled`: the transfer server), each batch first waits up to this long for
    the previous handoffs' pulls, so the next prefill does not stall them.
    `layerwise`: the layer groups of a layer-wise transfer, used for batches whose
    bucket is at least `layerwise_min_tokens` long; each group's pages are sent as a
    `KVPart` as soon as they are computed, overlapping the transfer with the next
    groups' compute. Shorter buckets (or `layerwise=None`) send the whole KV at once.
    `cache`: this mesh's paged pool (`PrefillCache`); every batch then computes into
    its pages (only its requests' uncached tokens, when the pool reuses pages: prefix
    caching), and sends the whole KV at once.
    `chunk_tokens`: a prompt longer than the scheduler's largest bucket (the scheduler
    is `chunked`) is prefilled into `cache`'s pages in chunks of this many tokens, each
    attending to the pages of the chunks before it; one chunk per `run_once`, taking
    turns with the other batches, so a long prompt never holds the short ones for
    its whole prefill. Its KV leaves once the last chunk has sampled its first token.
    `hold_first_token`: the decode mesh that takes the handoff is in this process; a
    first token is streamed when its request decodes there (`Request.append_token`),
    so the transfer shows in its time to first token, not as a gap before its second.
    """

    def __init__(self, runner: PrefillRunner, scheduler: PrefillScheduler, sender: KVSender,
                 requests: Requests, inbox: queue.SimpleQueue, page_size: int,
                 stats: StatsCounter, *, on_decode_mesh: bool = False,
                 layerwise: list[tuple[int, int]] | None = None, layerwise_min_tokens: int = 0,
                 handoff_wait_s: float = 0.0, cache: PrefillCache | None = None,
                 chunk_tokens: int | None = None, fingerprint: str = "",
                 hold_first_token: bool = False):
        self.runner, self.scheduler, self.sender = runner, scheduler, sender
        self.requests, self.inbox = requests, inbox
        self.page_size, self.stats = page_size, stats
        self.on_decode_mesh = on_decode_mesh
        self.layerwise = layerwise if layerwise and len(layerwise) > 1 else None
        self.layerwise_min_tokens = layerwise_min_tokens
        self.handoff_wait_s = handoff_wait_s
        self.cache = cache
        self.fingerprint = fingerprint     # stamped on every handoff (`models.fingerprint`)
        self.chunk_tokens = chunk_tokens
        self.hold_first_token = hold_first_token
        if scheduler.chunked and (cache is None or chunk_tokens is None):
            raise ValueError("a chunked prefill scheduler needs a paged pool and chunk_tokens")
        self._running = False                  # a batch is being run (its pages held)
        self._chunking: _Chunking | None = None
        self._chunk_turn = False               # the long prompt's next chunk goes next
        self._wait_pulled = getattr(sender, "wait_pulled", None) if handoff_wait_s > 0 else None

    @property
    def busy(self) -> bool:
        """A batch is running, or a long prompt holds pages between its chunks."""
        return self._running or self._chunking is not None

    def uses_layerwise(self, bucket: int) -> bool:
        return (self.layerwise is not None and self.cache is None and self.layerwise_min_tokens > 0
                and bucket >= self.layerwise_min_tokens)

    def take_queued(self) -> None:
        """Move the requests queued for this loop into its scheduler."""
        while True:
            try:
                r = self.inbox.get_nowait()
            except queue.Empty:
                return
            if r.is_final:
                continue
            try:
                self.scheduler.add(r)
            except ValueError as e:
                # `Requests` checks every request against this engine's limits; one
                # that still has no bucket here fails alone, never the loop.
                if r.abort(f"refused: {e}"):
                    self.stats.add(aborted=1)

    def run_once(self, now: float) -> tuple[bool, float | None]:
        """Run one batch (or one chunk of a long prompt) if one is due. Returns (ran,
        seconds until one may be due)."""
        self.take_queued()
        if self._chunking is not None and self._chunk_turn:
            return self._chunk_step()
        # A long prompt waits in its lane until its chunk programs are compiled
        # (in the background after warm-up); shorter ones go meanwhile.
        long_ok = self._chunking is None and (self.cache is None or self.cache.chunks_ready())
        batch, wait = self.scheduler.schedule(now, long_ok=long_ok)
        if batch is None:
            return self._chunk_step() if self._chunking is not None else (False, wait)
        if self._wait_pulled is not None:
            # The last batch's pages are pulled by the decode side from this process:
            # let that finish before a long prefill takes the devices (and cores).
            if self._wait_pulled(self.handoff_wait_s):
                self.stats.add(handoff_waits_expired=1)
        self._running = True
        try:
            live = self._start(batch)
            if batch.chunked:
                if live:
                    self._start_chunking(live[0])
                    return self._chunk_step()
                return True, 0.0
            self._chunk_turn = self._chunking is not None
            if self.cache is not None:
                self._run_cached(live, batch)
                return True, 0.0
            tokens, lengths, sampling = self._inputs(batch, live)
            computed = int(lengths[:len(live)].sum())
            self.stats.add(prefill_batches=1, prefill_tokens=computed,
                           prefill_computed_tokens=computed, prefill_padded_tokens=tokens.size)
            if self.uses_layerwise(batch.length):
                self._run_layerwise(live, tokens, lengths, sampling)
            else:
                self._run_whole(live, tokens, lengths, sampling)
            return True, 0.0
        finally:
            self._running = False

    def _start_chunking(self, r: Request) -> None:
        """Take pages for all of `r`'s tokens (sharing its cached prefix, when the pool
        reuses pages); its chunks compute the rest (`_chunk_step`)."""
        [(pages, cached, hashes)] = self.cache.admit([r])
        self._chunking = _Chunking(r, pages, cached, hashes, cached, self.cache.restored_tokens)

    def _end_chunking(self) -> None:
        c, self._chunking = self._chunking, None
        if c is not None:
            self.cache.release([c.pages])

    def _chunk_step(self) -> tuple[bool, float | None]:
        """The next chunk of the long prompt in progress; after its last, the first
        token and the handoff. An aborted request's pages are freed here, unused."""
        c, cache, page_size = self._chunking, self.cache, self.page_size
        self._chunk_turn = False
        r = c.request
        if r.is_final:
            self._end_chunking()
            return True, 0.0
        self._running = True
        try:
            ids = r.prefill_ids
            n, start = len(ids), c.done
            new = min(self.chunk_tokens, n - start)
            length = next(t for t in cache.coarse_new_buckets(self.chunk_tokens,
                                                              self.scheduler.buckets)
                          if t >= new)
            width = chunk_width(start // page_size, self.chunk_tokens // page_size,
                                cache.max_pages)
            tokens = np.zeros((1, length), np.int32)
            tokens[0, :new] = ids[start:start + new]
            prefix = np.zeros((1, width), np.int32)
            prefix[0, :start // page_size] = c.pages[:start // page_size]
            own = c.pages[start // page_size:start // page_size + pages_for(new, page_size)]
            new_table = np.zeros((1, pages_for(length, page_size)), np.int32)
            new_table[0, :len(own)] = own
            sampling = SamplingArrays.empty(1)
            sampling.set_row(0, r)
            context = np.zeros((1, cache.context_width()), np.int32)
            context[0, :n] = ids
            first, logprobs = cache.run_chunk(tokens, start, new, prefix, new_table, sampling,
                                              context)
            c.done += new
            self.stats.add(prefill_tokens=new, prefill_computed_tokens=new,
                           prefill_padded_tokens=tokens.size)
            if c.done < n:
                return True, 0.0
            self.stats.add(prefill_batches=1, prefill_cache_query_tokens=n if cache.reuse else 0,
                           prefill_cache_hit_tokens=c.cached - c.restored,
                           prefill_cache_host_hit_tokens=c.restored)
            cache.publish(c.pages, c.hashes, c.cached // page_size)
            if not self._first_token(r, 0, int(first[0]), logprobs, time.perf_counter()):
                skip = self._skip_pages(r, n)
                k_pages, v_pages = cache.take(c.pages[skip:])
                if r.transition(State.TRANSFERRING) and \
                        self._send(r, n, int(first[0]), k_pages, v_pages, first_page=skip):
                    self.requests.handed_off(r)
            self._end_chunking()
            return True, 0.0
        except BaseException:
            self._end_chunking()
            raise
        finally:
            self._running = False

    def _start(self, batch: PrefillBatch) -> list[Request]:
        """The batch's requests that are still live, now PREFILLING."""
        live = []
        for r in batch.requests:
            if not r.transition(State.PREFILLING):
                continue                       # aborted since it was scheduled
            r.timings.local_prefill |= self.on_decode_mesh
            if r.timings.prefill_start is None:
                r.timings.prefill_start = time.perf_counter()
            live.append(r)
        self.stats.add(local_prefills=len(live) if self.on_decode_mesh else 0)
        return live

    @staticmethod
    def _inputs(batch: PrefillBatch, live: list[Request]):
        tokens = np.zeros((batch.batch_size, batch.length), np.int32)
        lengths = np.ones(batch.batch_size, np.int32)
        sampling = SamplingArrays.empty(batch.batch_size)
        for i, r in enumerate(live):
            ids = r.prefill_ids
            tokens[i, :len(ids)] = ids
            lengths[i] = len(ids)
            sampling.set_row(i, r)
        return tokens, lengths, sampling

    def _run_whole(self, live: list[Request], tokens, lengths, sampling) -> None:
        first, logprobs, k, v = self.runner.run(tokens, lengths, sampling)
        now = time.perf_counter()
        going = []                             # (request, tokens, first page to send)
        for i, r in enumerate(live):
            n = int(lengths[i])
            if not self._first_token(r, i, int(first[i]), logprobs, now):
                going.append((i, r, n, self._skip_pages(r, n)))
        # Every row's pages are cut (dispatched) before any is sent: one call, so a
        # mesh spanning processes tells its followers once per batch.
        pages = self.runner.take_rows(k, v, [(i, skip, pages_for(n, self.page_size) - skip)
                                             for i, _, n, skip in going])
        for (i, r, n, skip), (k_pages, v_pages) in zip(going, pages):
            if not r.transition(State.TRANSFERRING):
                continue                       # aborted meanwhile
            if self._send(r, n, int(first[i]), k_pages, v_pages, first_page=skip):
                self.requests.handed_off(r)

    def _run_cached(self, live: list[Request], batch: PrefillBatch) -> None:
        """Prefill with context through the cache (`PrefillCache`): each row computes
        only the tokens after its cached prefix; its pages are cut from the pool. Unless
        the prefix is read in place (`PrefillCache.prefix_in_place`), a batch whose new
        tokens still need the whole bucket computes all its tokens with no prefix: its
        hits would save nothing and cost the prefix's attention over the table's whole
        width. So does a batch whose program with a prefix is still compiling
        (`PrefillCache.ready`; never with the prefix read in place)."""
        cache, page_size = self.cache, self.page_size
        # Pool pages now; host tier pages only once the batch will use its prefix.
        admitted = cache.admit(live, restore=False)
        try:
            hint = [row[1] + cache.restorable(r, row) for r, row in zip(live, admitted)]
            def needed(cached: list[int]) -> int:
                return max((r.num_tokens - c for r, c in zip(live, cached)), default=1)
            length = next(t for t in cache.new_buckets(batch.length, self.scheduler.buckets)
                          if t >= needed(hint))
            if length < batch.length and not cache.ready(batch.batch_size, length,
                                                         cache.width(batch.length)):
                length = batch.length          # its program compiles in the background
                self.stats.add(prefill_cache_cold_batches=1)
            with_prefix = length < batch.length or cache.prefix_in_place
            if with_prefix and hint != [c for _, c, _ in admitted]:
                admitted = cache.restore(live, admitted)
                if needed([c for _, c, _ in admitted]) > length:
                    length = batch.length      # the store held less than it said
        except BaseException:
            cache.release([pages for pages, _, _ in admitted])
            raise
        if length == batch.length and not cache.prefix_in_place and \
                any(c for _, c, _ in admitted):
            cache.release([pages for pages, _, _ in admitted])
            admitted = cache.admit(live, share=False)
        try:
            rows = batch.batch_size
            width = cache.fresh_width(batch.length) if length == batch.length else \
                cache.width(batch.length)
            tokens = np.zeros((rows, length), np.int32)
            starts = np.zeros(rows, np.int32)
            lengths = np.ones(rows, np.int32)  # padding rows: one token, to the null page
            prefix_tables = np.zeros((rows, width), np.int32)
            new_tables = np.zeros((rows, pages_for(length, page_size)), np.int32)
            sampling = SamplingArrays.empty(rows)
            for i, (r, (pages, cached, _)) in enumerate(zip(live, admitted)):
                new = r.prefill_ids[cached:]
                tokens[i, :len(new)] = new
                starts[i], lengths[i] = cached, len(new)
                prefix_tables[i, :cached // page_size] = pages[:cached // page_size]
                own = pages[cached // page_size:]
                new_tables[i, :len(own)] = own
                sampling.set_row(i, r)
            computed = int(lengths[:len(live)].sum())
            self.stats.add(prefill_batches=1, prefill_tokens=computed,
                           prefill_computed_tokens=computed, prefill_padded_tokens=tokens.size,
                           prefill_cache_query_tokens=sum(r.num_tokens for r in live)
                           if cache.reuse else 0,
                           prefill_cache_hit_tokens=sum(c for _, c, _ in admitted)
                           - cache.restored_tokens,
                           prefill_cache_host_hit_tokens=cache.restored_tokens)
            first, logprobs = cache.run(tokens, starts, lengths, prefix_tables, new_tables,
                                        sampling)
            for pages, cached, hashes in admitted:
                cache.publish(pages, hashes, cached // page_size)
            now = time.perf_counter()
            for i, (r, (pages, _, _)) in enumerate(zip(live, admitted)):
                n = int(starts[i] + lengths[i])
                if self._first_token(r, i, int(first[i]), logprobs, now):
                    continue
                skip = self._skip_pages(r, n)
                k_pages, v_pages = cache.take(pages[skip:])
                if r.transition(State.TRANSFERRING) and \
                        self._send(r, n, int(first[i]), k_pages, v_pages, first_page=skip):
                    self.requests.handed_off(r)
        finally:
            cache.release([pages for pages, _, _ in admitted])

    def _run_layerwise(self, live: list[Request], tokens, lengths, sampling) -> None:
        """Send each layer group's pages as soon as they are computed; the first token
        rides on the last part (it is sampled after the last layer). A request that
        ends with its first token, or is aborted meanwhile, gets no further parts: the
        decode side frees its reserved slot when it sees the request final (in one
        process) or is told by the router (across processes)."""
        skips = [self._skip_pages(r, int(lengths[i])) for i, r in enumerate(live)]
        rows = [(i, skips[i], pages_for(int(lengths[i]), self.page_size) - skips[i])
                for i in range(len(live))]
        first_dev, logprobs_dev, parts = self.runner.run_layerwise(tokens, lengths, sampling,
                                                                   self.layerwise, rows)
        streams = [secrets.randbits(63) for _ in live]
        sending = [r.transition(State.TRANSFERRING) for r in live]
        count = len(parts)
        for g, group in enumerate(parts[:-1]):
            jax.block_until_ready(group)       # group g is computed; g+1 computes on
            start = self.layerwise[g][0]
            for i, r in enumerate(live):
                if sending[i] and not r.is_final:
                    k_pages, v_pages = group[i]
                    sending[i] = self._send(r, int(lengths[i]), -1, k_pages, v_pages,
                                            KVPart(streams[i], g, count, start), skips[i])
        first = np.asarray(first_dev)
        logprobs = jax.device_get(logprobs_dev) if sampling.wants_logprobs else None
        now = time.perf_counter()
        for i, r in enumerate(live):
            if self._first_token(r, i, int(first[i]), logprobs, now) or not sending[i]:
                continue
            k_pages, v_pages = parts[-1][i]
            if self._send(r, int(lengths[i]), int(first[i]), k_pages, v_pages,
                          KVPart(streams[i], count - 1, count, self.layerwise[-1][0]),
                          skips[i]):
                self.requests.handed_off(r)

    def _first_token(self, r: Request, row: int, token: int, logprobs: Logprobs | None,
                     now: float) -> bool:
        """Record the prefill's sampled token of batch row `row` (with its
        log-probabilities, when read back); True if the request is final after it."""
        if r.timings.prefill_end is None:
            r.timings.prefill_end = now
        if r.append_token(token, now, None if logprobs is None else logprobs.of_row(row, r),
                          hold=self.hold_first_token):
            self.stats.add(finished=int(r.state is State.FINISHED))
            return True
        return False

    def _skip_pages(self, r: Request, n: int) -> int:
        """Leading pages of `r`'s `n` tokens its handoff leaves out: the full pages its
        decode side is believed to hold cached (`Request.kv_skip_pages`), never the last
        page (at least one travels), none once a handoff found that belief stale."""
        if r.kv_skip_missed:
            return 0
        return max(0, min(r.kv_skip_pages, (n - 1) // self.page_size))

    def _send(self, r: Request, n: int, first: int, k_pages, v_pages,
              part: KVPart | None = None, first_page: int = 0) -> bool:
        """Hand (part of) `r`'s KV on; False if it failed (and `r` with it)."""
        payload = self.requests.payload_of(r, n)
        try:
            self.sender.send(KVHandoff(r.request_id, n, first, k_pages, v_pages, payload,
                                       r.destination, part, first_page, self.fingerprint))
            return True
        except TransferError as e:
            # The decode side is unreachable or full: fail this request so the
            # router can retry it elsewhere; the loop keeps serving.
            self.stats.add(transfer_failures=1, aborted=int(r.abort(f"failed: transfer: {e}")))
            return False


@dataclasses.dataclass
class _Chunking:
    """A long prompt between its chunks: its pages, hashes and cached prefix
    (`PrefillCache.admit`), how many of its tokens have KV so far, and how many of
    the cached ones came from the host tier."""
    request: Request
    pages: list[int]
    cached: int
    hashes: list[bytes]
    done: int
    restored: int = 0
