"""`DecodeLoop`: continuous batching over the decode mesh's paged KV pool.

Each `iterate` receives new transfers, admits them into free slots (FIFO), inserts the
pages of those that have arrived, dispatches one decode step for every ready slot and
reads back the previous step's tokens. Transfers are `Inbound`s (`transfer.inbound`):
this loop never sees how the bytes travel, only whether they are there yet.

It owns no thread: the engine calls it from `jaxpd-decode` (or, colocated, from the
one engine thread). Only that thread touches the schedulers and the donated pool.

A handoff is refused as it is received -- before a slot, a page or a device op --
when it belongs to no request here, contradicts this pool's own numbers
(`transfer.inbound.HandoffSpec`), or covers another number of tokens than its request
holds: its request is prefilled again (`transfer_failures`), or aborted with the
reason when no slot here could ever hold it, so admission never waits on it. Every
refusal counts in `handoffs_rejected`. Nothing a peer sends raises out of `iterate`:
what does is the engine's own failure, and the engine surfaces it (`Engine.error`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import numpy as np

from jaxpd.engine.loops.extend_loop import ExtendLoop
from jaxpd.engine.kv.migration import moved
from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.engine.scheduling.registry import Requests
from jaxpd.engine.programs.decode_runner import DecodeRunner
from jaxpd.engine.programs.sampler import Logprobs, SamplingArrays
from jaxpd.engine.scheduling.buckets import context_width, decode_batch_sizes
from jaxpd.engine.scheduling.scheduler import DecodeScheduler, StepPlan
from jaxpd.request import Request, State, handoff_logprobs
from jaxpd.stats import StatsCounter
from jaxpd.transfer.connector import TransferError
from jaxpd.transfer.inbound import (PENDING, HandoffNeverFits, HandoffRejected, Inbound,
                                    InboundQueue, ModelMismatch, Placed, wait_any)

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Admitted:
    """A transfer with a reserved slot, its pages still on their way."""
    slot: int
    request: Request
    pages: list[int]
    inbound: Inbound


class DecodeLoop:
    """One step in flight: step k+1 is dispatched before the tokens of step k are read
    back, so host bookkeeping overlaps device work. A request that finished at step k
    therefore rides along in step k+1, whose token for it is dropped; its pages were
    sized with one token of lookahead for exactly that.

    Transfers never stall the steps: a request's slot and pages are reserved on
    admission, the pages move on `jaxpd-transfer` threads, and this loop inserts them
    (it alone touches the donated pool) on a later iteration."""

    def __init__(self, runner: DecodeRunner, scheduler: DecodeScheduler,
                 inbound: list[InboundQueue], requests: Requests, stats: StatsCounter,
                 max_pages_per_slot: int, context_step: int = 8, max_prefetch: int = 8,
                 by_length: bool = False, extend: ExtendLoop | None = None):
        self.runner, self.scheduler, self.inbound = runner, scheduler, inbound
        # The attention core reads each slot only up to its length: one context width.
        self.by_length = by_length
        self.batch_sizes = decode_batch_sizes(
            scheduler.slots_per_shard,
            from_one=getattr(runner, "quant_matmul", None) is not None)
        self.max_prefetch = max_prefetch
        self.requests, self.stats = requests, stats
        self.max_pages_per_slot, self.context_step = max_pages_per_slot, context_step
        # Prefill with context into slots (prefix caching, colocated chunks), between
        # steps on this thread: it alone touches the pool.
        self.extend = extend
        self.pending: collections.deque[tuple[Inbound, Request]] = collections.deque()  # FIFO
        self._admitted: list[_Admitted] = []
        num_slots = len(scheduler.slots)
        self._stepped: list[Request | None] = [None] * num_slots  # who each slot fed last step
        self._first_token = np.zeros(num_slots, np.int32)
        # The step dispatched last: its plan, tokens and `Logprobs` (None when no row
        # asked), all still on device.
        self._in_flight: tuple[StepPlan, jax.Array, Logprobs | None] | None = None
        self._awaiting_parts = False

    @property
    def idle(self) -> bool:
        return (not self.pending and not self._admitted and self._in_flight is None
                and self.scheduler.num_active() == 0
                and (self.extend is None or self.extend.idle))

    def iterate(self, receive_timeout: float | None) -> None:
        """Receive, admit, insert, dispatch a step, then read back the previous one."""
        timeout = receive_timeout if self.idle else (0.005 if self._awaiting_parts else None)
        self._awaiting_parts = False
        if self.extend is not None and self.extend.host is not None:
            self.extend.host.settle()          # the host tier's copies that are done
        self._wait_and_receive(timeout)
        self._mirror_first_tokens()
        self._release_final()
        self._admit()
        if self.extend is not None:
            for slot, r, token in self.extend.run_once():
                self.take_ready(slot, r, token)
        self._insert_arrived()
        plan = self.scheduler.plan_step()
        self.stats.add(preemptions=len(plan.preempted))
        for r in plan.preempted:
            r.timings.num_preemptions += 1
        dispatched = None
        if plan.entries:
            dispatched = (plan, *self._dispatch(plan))
            self.scheduler.advance(plan)
        if self._in_flight is not None:
            self._emit(*self._in_flight)
        self._in_flight = dispatched
        for r in plan.preempted:
            self.requests.resubmit(r)
        if dispatched is None and self._admitted:
            # Only transfers in progress: wait for one (or for the next layer-wise part,
            # in the next receive) instead of spinning.
            self._awaiting_parts = not wait_any([a.inbound for a in self._admitted], 0.01)

    def finish_in_flight(self) -> None:
        """Read back the step in flight (at shutdown)."""
        if self._in_flight is not None:
            self._emit(*self._in_flight)
            self._in_flight = None

    def drain(self, timeout_s: float) -> None:
        """Before an elastic re-split replaces this loop (nothing is sent meanwhile):
        receive all sent, insert what holds a slot (stepping meanwhile; what is not
        placed within `timeout_s` is prefilled again), read back the step in flight."""
        deadline = time.monotonic() + timeout_s
        while self._admitted and time.monotonic() < deadline or self._receive(0):
            self.iterate(receive_timeout=0)
        for a in list(self._admitted):
            self._drop(a)
            self._fail_transfer(a.request, TransferError("not placed before a re-split"))
        self.finish_in_flight()

    # How often an idle loop with an extend loop looks at the extend inbox while it
    # waits for a handoff: the most a request routed there waits to be seen.
    EXTEND_POLL_S = 0.002

    def _wait_and_receive(self, timeout: float | None) -> int:
        """`_receive`, waiting up to `timeout` s for a handoff -- or, with an extend loop,
        until a request arrives in its inbox (which the connector does not wake)."""
        if not timeout or self.extend is None:
            return self._receive(timeout)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            taken = self._receive(min(self.EXTEND_POLL_S, max(left, 0.0)) or None)
            if taken or left <= 0 or not self.extend.idle:
                return taken

    def _receive(self, timeout: float | None) -> int:
        """Take what the inbound queues hold; returns how many new handoffs."""
        taken = 0
        for queue in self.inbound:
            inbounds, rejected = queue.receive(timeout)
            for x in rejected:
                self._refuse(x.handoff.request_id, x.handoff.payload, queue.remote, x.error)
            for inbound in inbounds:
                key = (inbound.request_id, inbound.payload, inbound.remote)
                try:
                    r = self.requests.resolve(*key)
                except ValueError as e:
                    self._refuse(*key, HandoffRejected(str(e)), inbound)
                    continue
                if r.state is State.TRANSFERRING and \
                        inbound.num_tokens not in (r.num_tokens - 1, r.num_tokens):
                    # It waits for KV of its prompt + output so far (the first token
                    # may be appended already): any other count is not its KV.
                    self._refuse(*key, HandoffRejected(
                        f"handoff of {r.request_id!r} covers {inbound.num_tokens} tokens, "
                        f"the request holds {r.num_tokens}"), inbound)
                    continue
                self.pending.append((inbound, r))
            taken += len(inbounds) + len(rejected)
            timeout = None
        return taken

    def _prefetch_waiting(self) -> None:
        """Handoffs from another process that wait for a slot start moving at once,
        onto dp shard 0: their pages are served by the prefill process, whose next batch
        waits for the pull, so the pull must not wait for a
        slot to free. At most `max_prefetch` of them hold pages outside the pool this
        way, oldest first; once admitted, `Inbound` moves them to their slot's shard."""
        started = sum(i.started for i, _ in self.pending)
        for inbound, _ in self.pending:
            if started >= self.max_prefetch:
                return
            if inbound.remote and not inbound.started and inbound.error is None:
                inbound.start(self.runner.shard_sharding(0), self._expect(inbound))
                started += 1

    def _expect(self, inbound: Inbound) -> jax.ShapeDtypeStruct:
        """The shape and dtype a transfer's pages take in the pool."""
        pool = self.runner.k_pool
        return jax.ShapeDtypeStruct((pool.shape[0], inbound.num_pages) + pool.shape[2:],
                                    pool.dtype)

    def _refuse(self, request_id: str, payload, remote: bool, error: HandoffRejected,
                inbound: Inbound | None = None) -> None:
        """A handoff that will not be placed. Its request, if it waits for exactly this
        (no transfer of it holds a slot), is prefilled again -- or aborted with the
        reason, when no slot here could ever hold it."""
        if inbound is not None:
            inbound.end()
        self.stats.add(handoffs_rejected=1,
                       handoffs_model_mismatch=int(isinstance(error, ModelMismatch)))
        _log.warning("refused a KV handoff of %r: %s", request_id, error)
        try:
            r = self.requests.resolve(request_id, payload, remote)
        except ValueError:
            return                             # nobody here waits for it
        if r.state is not State.TRANSFERRING or self.scheduler.slot_of(r) is not None:
            return
        if isinstance(error, HandoffNeverFits):
            if r.abort(f"refused: {error}"):
                self.stats.add(aborted=1)
        elif self.requests.resubmit(r):
            self._count_failure(r, error, payload)

    def _mirror_first_tokens(self) -> None:
        """A request prefilled in another process learns its first token from the
        handoff (the last part of a layer-wise one), as soon as it arrives, and its
        log-probabilities from the handoff's wire form. Malformed ones fail the
        transfer: the request is prefilled again here. The token is held
        (`Request.append_token`) and streamed when the request decodes
        (`take_ready`), so the stream's second token never waits for the insert."""
        waiting = list(self.pending) + [(a.inbound, a.request) for a in self._admitted]
        for inbound, r in waiting:
            if (inbound.first_token is not None and r.state is State.TRANSFERRING
                    and r.num_tokens == inbound.num_tokens):
                try:
                    logprobs = handoff_logprobs(inbound.payload, r.params.logprobs)
                except ValueError as e:
                    self._fail_transfer(r, HandoffRejected(f"{r.request_id!r}: {e}"),
                                        payload=inbound.payload)
                    continue
                if r.append_token(inbound.first_token, time.perf_counter(), logprobs,
                                  hold=True):
                    self.stats.add(finished=int(r.state is State.FINISHED))

    def _release_final(self) -> None:
        for i, s in enumerate(self.scheduler.slots):
            if s is not None and s.request.is_final:
                self.scheduler.release(i)

    def _admit(self) -> None:
        """Reserve a slot and pages for each received transfer, oldest first, and start
        moving its pages there; stop at the first that does not fit yet."""
        while self.pending:
            inbound, r = self.pending[0]
            if r.state is State.TRANSFERRING:
                self._supersede(r, inbound)
            if r.state is not State.TRANSFERRING or self.scheduler.slot_of(r) is not None:
                # Cancelled or done meanwhile; or stale: re-prefilled meanwhile, or a
                # second prefill of it (a router retry) while the first one has a slot.
                self.pending.popleft()
                inbound.end()
                continue
            if inbound.error is not None:      # a later part failed already
                self.pending.popleft()
                self._fail_transfer(r, inbound.error, inbound)
                continue
            # Full pages of its prefix cached on a shard are shared, not inserted; the
            # leading `first_page` pages the handoff left out must be.
            first = inbound.first_page
            found = self.scheduler.find_slot(inbound.num_tokens, r.prefill_ids, min_shared=first)
            if found is None and first and not self.scheduler.holds_prefix(
                    r.prefill_ids[:inbound.num_tokens], first):
                self.pending.popleft()         # evicted since the hint: never decode
                r.kv_skip_missed = True        # from pages we do not have
                self.stats.add(prefix_skip_misses=1)
                self._fail_transfer(r, TransferError(
                    f"the first {first} pages its handoff left out are no longer cached "
                    f"here"), inbound)
                continue
            if found is None:                  # FIFO: wait for a slot or pages to free
                self._prefetch_waiting()
                return
            self.pending.popleft()
            slot, shared = found
            pages = self.scheduler.admit(slot, r, inbound.num_tokens, ready=False, shared=shared)
            if self.scheduler.caching:
                self.stats.add(prefix_query_tokens=inbound.num_tokens,
                               prefix_hit_tokens=len(shared) * self.scheduler.page_size)
            inbound.start(self.runner.shard_sharding(self.scheduler.shard_of(slot)),
                          self._expect(inbound))
            self._admitted.append(_Admitted(slot, r, pages, inbound))

    def _supersede(self, r: Request, new: Inbound) -> None:
        """A new prefill of `r` arrived while an older layer-wise transfer of it still
        waits for parts (its prefill worker died and the router retried): the new one
        wins, the old one's slot is freed for it."""
        for a in self._admitted:
            if (a.request is r and a.inbound.layerwise and not a.inbound.received_all
                    and new.stream != a.inbound.stream):
                self._drop(a)
                return

    def _drop(self, a: _Admitted) -> None:
        """Forget an admitted transfer and free its slot (if it still holds it)."""
        a.inbound.end()
        self._admitted.remove(a)
        s = self.scheduler.slots[a.slot]
        if s is not None and s.request is a.request:
            self.scheduler.release(a.slot)

    def _insert_arrived(self) -> None:
        """Insert the pages of finished transfers; a failed one is prefilled again."""
        now = time.monotonic()
        for a in list(self._admitted):
            s, r = self.scheduler.slots[a.slot], a.request
            if s is None or s.request is not r or r.state is not State.TRANSFERRING:
                self._drop(a)                  # aborted or finished meanwhile, or re-prefilled
                continue
            result = a.inbound.poll(now)
            if result is PENDING:
                continue
            if isinstance(result, Placed) and r.num_tokens != a.inbound.num_tokens + 1:
                result = TransferError(f"{r.request_id!r} holds {r.num_tokens} tokens, its KV "
                                       f"covers {a.inbound.num_tokens}: not its first token's")
            if isinstance(result, TransferError):
                self._drop(a)
                self._fail_transfer(r, result, payload=a.inbound.payload)
                continue
            self._admitted.remove(a)
            self._insert(a, result)

    def _fail_transfer(self, r: Request, error: TransferError, inbound: Inbound | None = None,
                       payload=None) -> None:
        """Never decode from pages we do not have: prefill again. `payload`: the failed
        handoff's (`inbound`'s when given)."""
        if inbound is not None:
            inbound.end()
            payload = inbound.payload
        self.stats.add(handoffs_rejected=int(isinstance(error, HandoffRejected)))
        self._count_failure(r, error, payload)
        self.requests.resubmit(r)

    def _count_failure(self, r: Request, error: Exception, payload) -> None:
        """A transfer of `r` failed and it is prefilled again. A migration's (its
        handoff came from another decode worker's pool, `engine.kv.migration`) counts as
        the failed move it is, and `r` keeps the reason for its Decode stream."""
        if moved(payload):
            r.move_failure = f"{type(error).__name__}: {error}"
            _log.warning("migration of %s failed after its KV was sent (%s); prefilling "
                         "it again here", r.request_id, r.move_failure)
            self.stats.add(migration_failures=1)
        else:
            _log.warning("transfer of %s failed (%s); re-prefilling", r.request_id, error)
            self.stats.add(transfer_failures=1)

    def _insert(self, a: _Admitted, placed: Placed) -> None:
        r, slot, inbound = a.request, a.slot, a.inbound
        # A shared page is never written: its rows of the handoff go to the null page.
        # The handoff holds the request's pages from `first` on (those before it are
        # shared: `_admit` made sure).
        # Its pages after the real ones are padding (`KVHandoff`): the insert sends them
        # to the null page.
        shared, first = self.scheduler.slots[slot].num_shared, inbound.first_page
        end = pages_for(inbound.num_tokens, self.scheduler.page_size)
        self.runner.insert(self.scheduler.shard_of(slot),
                           [0 if p < shared else a.pages[p] for p in range(first, end)],
                           placed.k, placed.v)
        # Its first token streams once the KV is in the pool: the copy and the insert
        # count in TTFT, and the gap to its second token is one step, not theirs too.
        # The next step would wait for them anyway, so no other stream waits longer.
        jax.block_until_ready((self.runner.k_pool, self.runner.v_pool))
        if inbound.counted:                    # a transfer between meshes, not on-mesh
            self.stats.add(transfers=1, layerwise_transfers=int(inbound.layerwise),
                           transfer_bytes=placed.num_bytes, transfer_s=placed.seconds,
                           prefix_saved_bytes=placed.num_bytes * first // inbound.num_pages)
            r.timings.transfer_s += placed.seconds
            r.timings.transfer_bytes += placed.num_bytes
        self.take_ready(slot, r, inbound.first_token)

    def take_ready(self, slot: int, r: Request, first_token: int) -> None:
        """`slot`'s KV is in place (inserted, or computed there): decode it from the next
        step on, fed `first_token` -- unless another thread moved the request since this
        one checked it: aborted (`_release_final` frees the slot), or sent back to prefill
        by `Engine.reprefill` (the slot is given back; its prefill brings KV again)."""
        if not r.transition_from((State.TRANSFERRING, State.PREFILLING), State.DECODING):
            if not r.is_final:
                self.scheduler.release(slot)
            return
        if r.params.has_penalties:
            self.runner.set_penalties(slot, r.prompt_ids, r.output_ids)
        r.timings.kv_ready = time.perf_counter()
        r.release_first_token(r.timings.kv_ready)
        self._first_token[slot] = first_token
        self._stepped[slot] = None
        self.scheduler.mark_ready(slot)

    def _dispatch(self, plan: StepPlan) -> tuple[jax.Array, Logprobs | None, dict[int, int]]:
        """One decode step for the plan's slots, over the fewest rows per dp shard of
        `batch_sizes` that hold each shard's stepped slots (padding rows name no slot).
        A slot fed last step takes its input token from that step's output, still on
        device; a newly inserted one takes its first token from the host
        (`fed_from_host`). Returns its tokens and, when some row asks for them, their
        `Logprobs` (both on device, by row), and each stepped slot's row."""
        sched = self.scheduler
        per, shards = sched.slots_per_shard, sched.num_shards
        busiest = collections.Counter(sched.shard_of(e.slot) for e in plan.entries)
        b = next(s for s in self.batch_sizes if s >= max(busiest.values()))
        n = shards * b
        width = context_width(plan.max_pages, self.context_step, self.max_pages_per_slot,
                              self.by_length)
        rows = np.full(n, per, np.int32)
        host_tokens = np.zeros(n, np.int32)
        fed_from_host = np.ones(n, bool)
        positions = np.zeros(n, np.int32)
        block_tables = np.zeros((n, width), np.int32)
        sampling = SamplingArrays.empty(n)
        stepped: list[Request | None] = [None] * len(sched.slots)
        row_of, filled = {}, [0] * shards
        for e in plan.entries:
            s, shard = sched.slots[e.slot], sched.shard_of(e.slot)
            i = row_of[e.slot] = shard * b + filled[shard]
            filled[shard] += 1
            rows[i] = e.slot - shard * per
            if self._stepped[e.slot] is e.request:
                fed_from_host[i] = False
            else:
                host_tokens[i] = self._first_token[e.slot]
            positions[i] = e.position
            block_tables[i, :len(s.pages)] = s.pages
            sampling.set_row(i, e.request)
            stepped[e.slot] = e.request
        self._stepped = stepped
        self.stats.add(decode_steps=1)
        tokens, logprobs = self.runner.step(host_tokens, fed_from_host, positions, block_tables,
                                            sampling, rows)
        return tokens, logprobs if sampling.wants_logprobs else None, row_of

    def _emit(self, plan: StepPlan, tokens_device, logprobs_device: Logprobs | None,
              row_of: dict[int, int]) -> None:
        """Read a step's tokens back (the only sync point per step; log-probabilities
        too, on the steps where some row asked) and hand each to its request (the slot's
        row: `row_of`); free the slots of requests that end with it."""
        tokens = np.asarray(tokens_device)
        logprobs = None if logprobs_device is None else jax.device_get(logprobs_device)
        now = time.perf_counter()
        for e in plan.entries:
            r = e.request
            if r.is_final:
                continue
            row = row_of[e.slot]
            lp = None if logprobs is None else logprobs.of_row(row, r)
            if r.append_token(int(tokens[row]), now, lp):
                self.stats.add(finished=int(r.state is State.FINISHED))
                slot = self.scheduler.slot_of(r)
                if slot is not None:
                    self.scheduler.release(slot)
