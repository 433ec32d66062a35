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
import secrets
import time
from concurrent import futures
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.page_allocator import pages_for
from jaxpd.request import Request, State
from jaxpd.runner import DecodeRunner, PrefillRunner, SamplingArrays
from jaxpd.scheduler import DecodeScheduler, PrefillScheduler, StepPlan
from transfer.connector import Connector, KVHandoff, KVPart, TransferError


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
    layerwise_transfers: int = 0
    local_prefills: int = 0
    finished: int = 0
    aborted: int = 0


class PrefillWorker:
    """Runs prefill batches and hands each request's KV to the connector.

    `layerwise`: the layer groups of a layer-wise transfer, used for batches whose
    bucket is at least `layerwise_min_tokens` long; each group's pages are sent as a
    `KVPart` as soon as they are computed, overlapping the transfer with the next
    groups' compute. Shorter buckets (or `layerwise=None`) send the whole KV at once.
    """

    def __init__(self, runner: PrefillRunner, scheduler: PrefillScheduler, connector: Connector,
                 page_size: int, counters: Counters, local: bool = False, wire: bool = False,
                 on_handed_off: Callable[[Request], None] | None = None,
                 layerwise: list[tuple[int, int]] | None = None, layerwise_min_tokens: int = 0):
        self.runner, self.scheduler, self.connector = runner, scheduler, connector
        self.page_size, self.counters = page_size, counters
        self.local = local   # prefilling on the decode mesh (counted apart)
        self.wire = wire     # the decode side is another process: send the wire form
        self.on_handed_off = on_handed_off
        self.layerwise = layerwise if layerwise and len(layerwise) > 1 else None
        self.layerwise_min_tokens = layerwise_min_tokens

    def uses_layerwise(self, bucket: int) -> bool:
        return (self.layerwise is not None and self.layerwise_min_tokens > 0
                and bucket >= self.layerwise_min_tokens)

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
        self.counters.prefill_batches += 1
        self.counters.prefill_tokens += int(lengths[:len(live)].sum())
        self.counters.prefill_padded_tokens += tokens.size
        if self.uses_layerwise(batch.length):
            self._run_layerwise(live, tokens, lengths, sampling)
            return True, 0.0
        first, k, v = self.runner.run(tokens, lengths, sampling)
        now = time.perf_counter()
        for i, r in enumerate(live):
            n = int(lengths[i])
            if self._first_token(r, int(first[i]), now):
                continue                       # finished by its first token, or aborted
            k_pages, v_pages = self.runner.take_pages(k, v, i, pages_for(n, self.page_size))
            if not r.transition(State.TRANSFERRING):
                continue
            if self._send(r, n, int(first[i]), k_pages, v_pages):
                self._handed_off(r)
        return True, 0.0

    def _run_layerwise(self, live: list[Request], tokens, lengths, sampling) -> None:
        """Send each layer group's pages as soon as they are computed; the first token
        rides on the last part (it is sampled after the last layer). A request that
        ends with its first token, or is aborted meanwhile, gets no further parts: the
        decode side frees its reserved slot when it sees the request final (in one
        process) or is told by the router (across processes)."""
        rows = [(i, pages_for(int(lengths[i]), self.page_size)) for i in range(len(live))]
        first_dev, parts = self.runner.run_layerwise(tokens, lengths, sampling, self.layerwise, rows)
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
                                            KVPart(streams[i], g, count, start))
        first = np.asarray(first_dev)
        now = time.perf_counter()
        for i, r in enumerate(live):
            if self._first_token(r, int(first[i]), now) or not sending[i]:
                continue
            k_pages, v_pages = parts[-1][i]
            if self._send(r, int(lengths[i]), int(first[i]), k_pages, v_pages,
                          KVPart(streams[i], count - 1, count, self.layerwise[-1][0])):
                self._handed_off(r)

    def _first_token(self, r: Request, token: int, now: float) -> bool:
        """Record the prefill's sampled token; True if the request is final after it."""
        if r.timings.prefill_end is None:
            r.timings.prefill_end = now
        if r.append_token(token, now):
            self.counters.finished += r.state is State.FINISHED
            return True
        return False

    def _send(self, r: Request, n: int, first: int, k_pages, v_pages,
              part: KVPart | None = None) -> bool:
        """Hand (part of) `r`'s KV to the connector; False if it failed (and `r` with it)."""
        payload = r.to_wire(num_tokens=n) if self.wire else r
        try:
            self.connector.send(KVHandoff(r.request_id, n, first, k_pages, v_pages, payload,
                                          r.destination, part))
            return True
        except TransferError as e:
            # The decode side is unreachable or full: fail this request so the
            # router can retry it elsewhere; the worker keeps serving.
            self.counters.transfer_failures += 1
            r.abort(f"failed: transfer: {e}")
            return False

    def _handed_off(self, r: Request) -> None:
        if self.wire and self.on_handed_off is not None:
            self.on_handed_off(r)


@dataclasses.dataclass
class _Placing:
    """A transfer in progress into a reserved slot: one `connector.place` future per
    part received so far; a request-level transfer is a single part."""
    slot: int
    request: Request
    pages: list[int]
    connector: Connector
    sharding: object
    count: int                      # parts expected
    stream: int | None              # the layer-wise stream, None for request-level
    deadline: float                 # monotonic: the next part is overdue after it
    num_pages: int                  # pages the KV fills (every part has all of them)
    futures: list[futures.Future] = dataclasses.field(default_factory=list)
    first_token: int = -1

    @property
    def received(self) -> bool:
        return len(self.futures) == self.count

    @property
    def done(self) -> bool:
        return self.received and all(f.done() for f in self.futures)

    @property
    def failed(self) -> BaseException | None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None


class DecodeWorker:
    """Continuous batching with one step in flight: step k+1 is dispatched before the
    tokens of step k are read back, so host bookkeeping overlaps device work. A request
    that finished at step k therefore rides along in step k+1, whose token for it is
    dropped; its pages were sized with one token of lookahead for exactly that.

    Transfers never stall the steps: a request's slot and pages are reserved on
    admission, `connector.place` runs on a `jaxpd-transfer` thread, and the decode thread
    inserts the arrived pages (it alone touches the donated pool) on a later iteration.
    A layer-wise transfer reserves the slot on its first part; each later part is
    placed as it arrives (it never waits behind other requests' admission), and the
    layers are joined and inserted once all have arrived. A part overdue by
    `part_timeout_s` fails the transfer: the request is prefilled again."""

    def __init__(self, runner: DecodeRunner, scheduler: DecodeScheduler,
                 connectors: list[Connector], resubmit: Callable[[Request], None],
                 resolve: Callable[[object], Request], counters: Counters,
                 max_pages_per_slot: int, part_timeout_s: float = 30.0):
        self.runner, self.scheduler, self.connectors = runner, scheduler, connectors
        self.resubmit, self.resolve, self.counters = resubmit, resolve, counters
        self.max_pages_per_slot = max_pages_per_slot
        self.part_timeout_s = part_timeout_s
        # Handoffs received but not yet admitted, with the connector that places them.
        self.pending: collections.deque[tuple[KVHandoff, Connector]] = collections.deque()
        num_slots = len(scheduler.slots)
        self._stepped: list[Request | None] = [None] * num_slots  # who each slot fed last step
        self._first_token = np.zeros(num_slots, np.int32)
        self._in_flight: tuple[StepPlan, object] | None = None
        self._preempted: list[Request] = []
        self._transfers = futures.ThreadPoolExecutor(4, thread_name_prefix="jaxpd-transfer")
        self._placing: list[_Placing] = []
        self._streams: dict[tuple[str, int], _Placing] = {}   # layer-wise, by (request, stream)
        self._awaiting_parts = False

    @property
    def idle(self) -> bool:
        return (not self.pending and not self._placing and self._in_flight is None
                and self.scheduler.num_active() == 0)

    def iterate(self, receive_timeout: float | None) -> None:
        """Receive, admit, dispatch a step, then read back the previous one."""
        timeout = receive_timeout if self.idle else (0.005 if self._awaiting_parts else None)
        self._awaiting_parts = False
        for connector in self.connectors:
            handoff = connector.receive(timeout)
            while handoff is not None:
                if handoff.part is not None and handoff.part.index > 0:
                    self._continue(handoff, connector)
                else:
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
            # Only transfers in progress: wait for one (or for the next layer-wise part,
            # in the next receive) instead of spinning.
            running = [f for p in self._placing for f in p.futures if not f.done()]
            if running:
                futures.wait(running, timeout=0.01, return_when=futures.FIRST_COMPLETED)
            else:
                self._awaiting_parts = True

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
            if h.part is not None and h.part.index > 0:
                # A later part queued behind its first part (both waited for a slot).
                self.pending.popleft()
                self._continue(h, connector)
                continue
            r = self.resolve(h.payload)
            if not r.is_final and r.state is State.TRANSFERRING:
                self._supersede(r, h)
            if not r.is_final and (r.state is not State.TRANSFERRING
                                   or self.scheduler.slot_of(r) is not None):
                # Stale: the request was re-prefilled meanwhile, or a second prefill of it
                # (a router retry) arrived while the first one's KV is already in a slot.
                self.pending.popleft()
                connector.discard(h)
                continue
            if h.part is None or h.part.is_last:
                self._mirror_first_token(r, h)
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
            p = _Placing(slot, r, pages, connector, sharding,
                         count=1 if h.part is None else h.part.count,
                         stream=None if h.part is None else h.part.stream,
                         deadline=time.monotonic() + self.part_timeout_s,
                         num_pages=h.num_pages)
            self._placing.append(p)
            self._place(p, h)
            if p.stream is not None:
                key = _stream_key(h)
                self._streams[key] = p
                # Its later parts that arrived while it waited for a slot go along now.
                ours = [_stream_key(x[0]) == key for x in self.pending]
                later = [x for x, mine in zip(self.pending, ours) if mine]
                self.pending = collections.deque(x for x, mine in zip(self.pending, ours)
                                                 if not mine)
                for x in later:
                    self._continue(*x)

    def _mirror_first_token(self, r: Request, h: KVHandoff) -> None:
        """A mirror from another process: its first token travelled with the KV (on
        the last part of a layer-wise transfer)."""
        if r.num_tokens == h.num_tokens and not r.is_final:
            if r.append_token(h.first_token, time.perf_counter()):
                self.counters.finished += r.state is State.FINISHED

    def _place(self, p: _Placing, h: KVHandoff) -> None:
        p.futures.append(self._transfers.submit(self._checked_place, p.connector, h, p.sharding))
        p.deadline = time.monotonic() + self.part_timeout_s
        if h.part is None or h.part.is_last:
            p.first_token = h.first_token

    def _checked_place(self, connector: Connector, h: KVHandoff, sharding):
        """`connector.place`, refusing pages that do not fit the pool (e.g. the peer
        compresses KV and this side does not): a failed transfer, never a crash."""
        k, v, stats = connector.place(h, sharding)
        pool = self.runner.k_pool
        layers = pool.shape[0] if h.part is None else k.shape[0]
        want = (layers, h.num_pages) + pool.shape[2:]
        for name, x in (("k", k), ("v", v)):
            if x.shape != want or x.dtype != pool.dtype:
                raise TransferError(
                    f"{h.request_id!r}: {name} pages arrived as {x.dtype}{list(x.shape)}, the "
                    f"pool needs {pool.dtype}{list(want)}: do prefill and decode serve the "
                    f"same model, dtype and kv_transfer_dtype?")
        return k, v, stats

    def _continue(self, h: KVHandoff, connector: Connector) -> None:
        """Route a layer-wise part after the first to its transfer in progress."""
        key = _stream_key(h)
        p = self._streams.get(key)
        if p is None:
            if any(_stream_key(x) == key for x, _ in self.pending):
                self.pending.append((h, connector))   # its first part still waits for a slot
            else:
                connector.discard(h)                   # its transfer ended (failed, cancelled)
            return
        if h.part.index != len(p.futures) or h.part.count != p.count:
            # Never assemble layers out of order: fail the transfer, prefill again.
            connector.discard(h)
            p.futures.append(_failed(TransferError(
                f"part {h.part.index}/{h.part.count} of {h.request_id!r} arrived after "
                f"{len(p.futures)}/{p.count} parts")))
            return
        if h.part.is_last:
            self._mirror_first_token(p.request, h)
        self._place(p, h)

    def _supersede(self, r: Request, h: KVHandoff) -> None:
        """A new prefill of `r` arrived while an older layer-wise transfer of it still
        waits for parts (its prefill worker died and the router retried): the new one
        wins, the old one's slot is freed for it."""
        slot = self.scheduler.slot_of(r)
        if slot is None:
            return
        for p in self._placing:
            if (p.slot == slot and p.request is r and p.stream is not None and not p.received
                    and (h.part is None or h.part.stream != p.stream)):
                self._end(p)
                self.scheduler.release(slot)
                return

    def _end(self, p: _Placing) -> None:
        """Forget a transfer; parts still to come are discarded when they arrive."""
        if p.stream is not None:
            self._streams.pop((p.request.request_id, p.stream), None)
        if p in self._placing:
            self._placing.remove(p)

    def _collect_placed(self) -> None:
        """Insert the pages of finished transfers; a failed one is prefilled again."""
        now = time.monotonic()
        for p in list(self._placing):
            s, r, slot = self.scheduler.slots[p.slot], p.request, p.slot
            if s is None or s.request is not r or r.state is not State.TRANSFERRING:
                # Aborted or finished meanwhile (slot released), or re-prefilled: drop it.
                self._end(p)
                if s is not None and s.request is r:
                    self.scheduler.release(slot)
                continue
            error = p.failed
            if error is None and not p.received and now > p.deadline:
                error = TransferError(f"part {len(p.futures)}/{p.count} of {r.request_id!r} "
                                      f"not received within {self.part_timeout_s:.1f}s")
            if error is None and p.done:
                results = [f.result() for f in p.futures]
                if len(results) == 1:
                    k, v = results[0][:2]
                else:   # layer-wise: join the groups' layers on the shard, insert once
                    k = jnp.concatenate([x[0] for x in results])
                    v = jnp.concatenate([x[1] for x in results])
                    if k.shape[0] != self.runner.k_pool.shape[0]:
                        error = TransferError(f"the parts of {r.request_id!r} hold {k.shape[0]} "
                                              f"layers, the model has {self.runner.k_pool.shape[0]}")
            if error is not None:
                if not isinstance(error, TransferError):
                    raise error
                # Never decode from pages we do not have: free the slot, prefill again.
                logging.warning("transfer of %s failed (%s); re-prefilling", r.request_id, error)
                self._end(p)
                self.scheduler.release(slot)
                self.counters.transfer_failures += 1
                if r.transition(State.WAITING):
                    self.resubmit(r)
                continue
            if not p.done:
                continue
            self._end(p)
            self.runner.insert(self.scheduler.shard_of(slot), p.pages[:p.num_pages], k, v)
            if p.connector is self.connectors[0]:   # the others are on-mesh (local prefill)
                num_bytes = sum(x[2].num_bytes for x in results)
                seconds = sum(x[2].seconds for x in results)
                self.counters.transfers += 1
                self.counters.layerwise_transfers += p.stream is not None
                self.counters.transfer_bytes += num_bytes
                self.counters.transfer_s += seconds
                r.timings.transfer_s += seconds
                r.timings.transfer_bytes += num_bytes
            r.timings.kv_ready = time.perf_counter()
            self._first_token[slot] = p.first_token
            self._stepped[slot] = None
            self.scheduler.mark_ready(slot)
            r.transition(State.DECODING)

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


def _stream_key(h: KVHandoff) -> tuple[str, int] | None:
    """Which layer-wise transfer a part belongs to (None: a request-level handoff)."""
    return None if h.part is None else (h.request_id, h.part.stream)


def _failed(error: BaseException) -> futures.Future:
    f: futures.Future = futures.Future()
    f.set_exception(error)
    return f
