"""Prefill and decode workers: each turns scheduler plans into runner calls.

Neither owns a thread; `engine.py` runs them (two threads when disaggregated, one
interleaving loop when colocated). Everything here is called from one thread per
worker, so the schedulers need no locks; requests cross between workers only through
the connector (prefill -> decode) and `resubmit` (decode -> prefill, preemption).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent import futures
from typing import Callable

import numpy as np

from jaxpd.page_allocator import pages_for
from jaxpd.request import Request, State
from jaxpd.runner import DecodeRunner, PrefillRunner, SamplingArrays
from jaxpd.scheduler import DecodeScheduler, PrefillScheduler, StepPlan
from transfer.connector import Connector, KVHandoff, TransferError


@dataclasses.dataclass
class Counters:
    """Engine-wide event counts (each written by one thread only)."""
    prefill_batches: int = 0
    prefill_tokens: int = 0
    prefill_padded_tokens: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    decode_steps: int = 0
    preemptions: int = 0
    transfer_failures: int = 0
    local_prefills: int = 0
    finished: int = 0
    aborted: int = 0


class PrefillWorker:
    def __init__(self, runner: PrefillRunner, scheduler: PrefillScheduler, connector: Connector,
                 page_size: int, counters: Counters, local: bool = False, wire: bool = False,
                 on_handed_off: Callable[[Request], None] | None = None):
        self.runner, self.scheduler, self.connector = runner, scheduler, connector
        self.page_size, self.counters = page_size, counters
        self.local = local   # prefilling on the decode mesh (counted apart)
        self.wire = wire     # the decode side is another process: send the wire form
        self.on_handed_off = on_handed_off

    def run_batch(self, now: float) -> tuple[bool, float | None]:
        """Run one batch if one is due. Returns (ran, seconds until one may be due)."""
        batch, wait = self.scheduler.schedule(now)
        if batch is None:
            return False, wait
        live = []
        for r in batch.requests:
            if not r.transition(State.PREFILLING):
                continue                       # aborted since it was scheduled
            r.timings.local_prefill |= self.local
            self.counters.local_prefills += self.local
            if r.timings.prefill_start is None:
                r.timings.prefill_start = time.perf_counter()
            live.append(r)
        tokens = np.zeros((batch.batch_size, batch.length), np.int32)
        lengths = np.ones(batch.batch_size, np.int32)
        sampling = SamplingArrays.empty(batch.batch_size)
        for i, r in enumerate(live):
            ids = r.prefill_ids
            tokens[i, :len(ids)] = ids
            lengths[i] = len(ids)
            sampling.set_row(i, r)
        first, k, v = self.runner.run(tokens, lengths, sampling)
        now = time.perf_counter()
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += int(lengths[:len(live)].sum())
        self.counters.prefill_padded_tokens += tokens.size
        for i, r in enumerate(live):
            n = int(lengths[i])
            if r.timings.prefill_end is None:
                r.timings.prefill_end = now
            if r.append_token(int(first[i]), now):
                self.counters.finished += r.state is State.FINISHED
                continue                       # finished by its first token, or aborted
            k_pages, v_pages = self.runner.take_pages(k, v, i, pages_for(n, self.page_size))
            if not r.transition(State.TRANSFERRING):
                continue
            payload = r.to_wire(num_tokens=n) if self.wire else r
            try:
                self.connector.send(KVHandoff(r.request_id, n, int(first[i]), k_pages, v_pages,
                                              payload, r.destination))
            except TransferError as e:
                # The decode side is unreachable or full: fail this request so the
                # router can retry it elsewhere; the worker keeps serving.
                self.counters.transfer_failures += 1
                r.abort(f"failed: transfer: {e}")
                continue
            if self.wire and self.on_handed_off is not None:
                self.on_handed_off(r)
        return True, 0.0


@dataclasses.dataclass
class _Placing:
    """A transfer in progress into a reserved slot."""
    future: futures.Future
    slot: int
    handoff: KVHandoff
    request: Request
    pages: list[int]
    connector: Connector


class DecodeWorker:
    """Continuous batching with one step in flight: step k+1 is dispatched before the
    tokens of step k are read back, so host bookkeeping overlaps device work. A request
    that finished at step k therefore rides along in step k+1, whose token for it is
    dropped; its pages were sized with one token of lookahead for exactly that.

    Transfers never stall the steps: a request's slot and pages are reserved on
    admission, `connector.place` runs on a `jaxpd-transfer` thread, and the decode thread
    inserts the arrived pages (it alone touches the donated pool) on a later iteration."""

    def __init__(self, runner: DecodeRunner, scheduler: DecodeScheduler,
                 connectors: list[Connector], resubmit: Callable[[Request], None],
                 resolve: Callable[[object], Request], counters: Counters,
                 max_pages_per_slot: int):
        self.runner, self.scheduler, self.connectors = runner, scheduler, connectors
        self.resubmit, self.resolve, self.counters = resubmit, resolve, counters
        self.max_pages_per_slot = max_pages_per_slot
        # Handoffs received but not yet admitted, with the connector that places them.
        self.pending: collections.deque[tuple[KVHandoff, Connector]] = collections.deque()
        num_slots = len(scheduler.slots)
        self._stepped: list[Request | None] = [None] * num_slots  # who each slot fed last step
        self._first_token = np.zeros(num_slots, np.int32)
        self._in_flight: tuple[StepPlan, object] | None = None
        self._preempted: list[Request] = []
        self._transfers = futures.ThreadPoolExecutor(4, thread_name_prefix="jaxpd-transfer")
        self._placing: list[_Placing] = []

    @property
    def idle(self) -> bool:
        return (not self.pending and not self._placing and self._in_flight is None
                and self.scheduler.num_active() == 0)

    def iterate(self, receive_timeout: float | None) -> None:
        """Receive, admit, dispatch a step, then read back the previous one."""
        timeout = receive_timeout if self.idle else None
        for connector in self.connectors:
            handoff = connector.receive(timeout)
            while handoff is not None:
                self.pending.append((handoff, connector))
                handoff = connector.receive(None)
            timeout = None
        self._release_final()
        self._admit()
        self._collect_placed()
        plan = self.scheduler.plan_step()
        for r in plan.preempted:
            self.counters.preemptions += 1
            r.timings.num_preemptions += 1
            self._preempted.append(r)
        dispatched = None
        if plan.entries:
            dispatched = (plan, self._dispatch(plan))
            self.scheduler.advance(plan)
        if self._in_flight is not None:
            self._process(*self._in_flight)
        self._in_flight = dispatched
        self._requeue_preempted()
        if dispatched is None and self._placing:
            # Only transfers in progress: wait for one instead of spinning.
            futures.wait([p.future for p in self._placing], timeout=0.01,
                         return_when=futures.FIRST_COMPLETED)

    def drain(self) -> None:
        """Read back the step in flight (at shutdown)."""
        if self._in_flight is not None:
            self._process(*self._in_flight)
            self._in_flight = None

    def close(self) -> None:
        """Stop the transfer threads; one still placing ends within its connector's
        timeout."""
        self._transfers.shutdown(wait=True, cancel_futures=True)

    def _release_final(self) -> None:
        for i, s in enumerate(self.scheduler.slots):
            if s is not None and s.request.is_final:
                self.scheduler.release(i)

    def _admit(self) -> None:
        while self.pending:
            h, connector = self.pending[0]
            r = self.resolve(h.payload)
            if not r.is_final and (r.state is not State.TRANSFERRING
                                   or self.scheduler.slot_of(r) is not None):
                # Stale: the request was re-prefilled meanwhile, or a second prefill of it
                # (a router retry) arrived while the first one's KV is already in a slot.
                self.pending.popleft()
                connector.discard(h)
                continue
            if r.num_tokens == h.num_tokens and not r.is_final:
                # A mirror from another process: its first token travelled with the KV.
                if r.append_token(h.first_token, time.perf_counter()):
                    self.counters.finished += r.state is State.FINISHED
            if r.is_final:                     # cancelled in transfer, or done at once
                self.pending.popleft()
                connector.discard(h)
                continue
            slot = self.scheduler.find_slot(h.num_tokens)
            if slot is None:
                return                         # FIFO: wait for a slot or pages to free
            self.pending.popleft()
            pages = self.scheduler.admit(slot, r, h.num_tokens, ready=False)
            sharding = self.runner.shard_sharding(self.scheduler.shard_of(slot))
            future = self._transfers.submit(connector.place, h, sharding)
            self._placing.append(_Placing(future, slot, h, r, pages, connector))

    def _collect_placed(self) -> None:
        """Insert the pages of finished transfers; a failed one is prefilled again."""
        still = []
        for p in self._placing:
            if not p.future.done():
                still.append(p)
                continue
            s, r, slot = self.scheduler.slots[p.slot], p.request, p.slot
            if s is None or s.request is not r:
                continue                       # aborted and released meanwhile: drop it
            try:
                k, v, stats = p.future.result()
            except TransferError as e:
                # Never decode from pages we do not have: free the slot, prefill again.
                logging.warning("transfer of %s failed (%s); re-prefilling", r.request_id, e)
                self.scheduler.release(slot)
                self.counters.transfer_failures += 1
                if r.transition(State.WAITING):
                    self.resubmit(r)
                continue
            h = p.handoff
            self.runner.insert(self.scheduler.shard_of(slot), p.pages[:h.num_pages], k, v)
            if p.connector is self.connectors[0]:   # the others are on-mesh (local prefill)
                self.counters.transfers += 1
                self.counters.transfer_bytes += stats.num_bytes
                self.counters.transfer_s += stats.seconds
                r.timings.transfer_s += stats.seconds
                r.timings.transfer_bytes += stats.num_bytes
            self._first_token[slot] = h.first_token
            self._stepped[slot] = None
            self.scheduler.mark_ready(slot)
            r.transition(State.DECODING)
        self._placing = still

    def _dispatch(self, plan: StepPlan):
        n = len(self.scheduler.slots)
        width = min(1 << (plan.max_pages - 1).bit_length(), self.max_pages_per_slot)
        override = np.zeros(n, np.int32)
        use_override = np.ones(n, bool)
        positions = np.zeros(n, np.int32)
        block_tables = np.zeros((n, width), np.int32)
        sampling = SamplingArrays.empty(n)
        stepped: list[Request | None] = [None] * n
        for e in plan.entries:
            s = self.scheduler.slots[e.slot]
            if self._stepped[e.slot] is e.request:
                use_override[e.slot] = False   # its input is last step's output, on device
            else:
                override[e.slot] = self._first_token[e.slot]
            positions[e.slot] = e.position
            block_tables[e.slot, :len(s.pages)] = s.pages
            sampling.set_row(e.slot, e.request)
            stepped[e.slot] = e.request
        self._stepped = stepped
        self.counters.decode_steps += 1
        return self.runner.step(override, use_override, positions, block_tables, sampling)

    def _process(self, plan: StepPlan, tokens_device) -> None:
        tokens = np.asarray(tokens_device)     # the only sync point per step
        now = time.perf_counter()
        for e in plan.entries:
            r = e.request
            if r.is_final:
                continue
            if r.append_token(int(tokens[e.slot]), now):
                self.counters.finished += r.state is State.FINISHED
                slot = self.scheduler.slot_of(r)
                if slot is not None:
                    self.scheduler.release(slot)

    def _requeue_preempted(self) -> None:
        for r in self._preempted:
            if r.transition(State.WAITING):
                self.resubmit(r)
        self._preempted.clear()
