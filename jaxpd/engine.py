"""The engine: meshes, runners, schedulers, workers, and the threads that drive them.

Threads (named, few; a dead one aborts every live request with its error and makes
`submit` raise, never a silent hang):
  disaggregated  jaxpd-prefill  inbox -> PrefillScheduler -> PrefillRunner -> connector
                 jaxpd-decode   connector -> DecodeScheduler/DecodeRunner -> request events
  colocated      jaxpd-engine   both of the above interleaved in one loop: a due
                                prefill batch runs first, then one decode step
Queues: `inbox` (submit/resubmit -> prefill; bounded by `max_queued` at submit) and the
connector's bounded handoff queue (prefill -> decode, backpressure on prefill).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.config import EngineConfig
from jaxpd.request import Request, State
from jaxpd.runner import CompileCounter, DecodeRunner, PrefillRunner, SamplingArrays
from jaxpd.scheduler import DecodeScheduler, PrefillScheduler
from jaxpd.workers import Counters, DecodeWorker, PrefillWorker
from models.checkpoint import LoadedModel
from models.hf_io import DTYPES
from models.llama import abstract_params, layer_groups
from sharding import build_meshes, logical_rules, named_shardings
from transfer.compressed import CompressingConnector
from transfer.connector import Connector
from transfer.device_put import DevicePutConnector


class QueueFull(RuntimeError):
    """Admission control said no: too many requests are waiting."""


class Engine:
    """Runs whichever phases this process's mesh spec has: both (one process, or
    colocated), prefill only, or decode only (multi-process deployments, where the
    connector crosses processes and payloads travel in wire form)."""

    def __init__(self, model: LoadedModel, config: EngineConfig,
                 connector: Connector | None = None, warmup: bool = False,
                 progress: Callable[[str], None] | None = None):
        self.model, self.config = model, config
        spec = config.mesh
        self.meshes = build_meshes(spec)
        self.dtype = DTYPES[config.dtype]
        _, self._logical = abstract_params(model.cfg, self.dtype)
        self.counter = CompileCounter()
        self.counters = Counters()
        self.connector = connector or DevicePutConnector()
        if config.kv_transfer_dtype is not None:
            c = model.cfg
            self.connector = CompressingConnector(
                self.connector, config.kv_transfer_dtype,
                (config.page_size, c.num_kv_heads, c.head_dim), config.dtype)
        self.prefill_worker = self.local_worker = self.decode_worker = None
        self.decode_scheduler = None
        if spec.has_prefill:
            self._build_prefill(wire=not spec.has_decode)
        if spec.has_decode:
            self._build_decode()
        if warmup:
            self._warmup(progress or (lambda msg: None))
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._local_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._live: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._wake = threading.Event()
        loops = ([("jaxpd-engine", self._colocated_loop)] if spec.colocated else
                 [("jaxpd-prefill", self._prefill_loop)] * spec.has_prefill +
                 [("jaxpd-decode", self._decode_loop)] * spec.has_decode)
        self._threads = [threading.Thread(target=self._guard, args=(loop,), name=name, daemon=True)
                         for name, loop in loops]
        for t in self._threads:
            t.start()

    def _params_on(self, mesh):
        rules = logical_rules(self.model.cfg, mesh)
        params = jax.tree.map(lambda a: a.astype(self.dtype), self.model.params)
        return jax.device_put(params, named_shardings(self._logical, mesh, rules)), rules

    def _prefill_scheduler(self, buckets: list[int]) -> PrefillScheduler:
        c = self.config
        return PrefillScheduler(buckets, c.max_prefill_batch, max(c.max_prefill_tokens, buckets[-1]),
                                c.bucket_timeout_ms / 1000, c.min_prefill_batch)

    def _build_prefill(self, wire: bool) -> None:
        c, mesh = self.config, self.meshes.prefill
        params, rules = self._params_on(mesh)
        self.prefill_runner = PrefillRunner(self.model.cfg, params, mesh, rules, c.page_size,
                                            self.counter, self.dtype)
        self.prefill_scheduler = self._prefill_scheduler(c.buckets)
        # Layer-wise transfer overlaps sending with computing; colocated, both run on
        # the same devices in one loop, so there is nothing to overlap.
        groups = None if c.mesh.colocated else layer_groups(self.model.cfg.num_layers,
                                                             c.layerwise_parts)
        self.prefill_worker = PrefillWorker(self.prefill_runner, self.prefill_scheduler,
                                            self.connector, c.page_size, self.counters,
                                            wire=wire, on_handed_off=self._handed_off,
                                            layerwise=groups,
                                            layerwise_min_tokens=c.layerwise_min_tokens)

    def _build_decode(self) -> None:
        c, mesh, spec = self.config, self.meshes.decode, self.config.mesh
        params, rules = self._params_on(mesh)
        num_shards = spec.decode_dp
        self.decode_runner = DecodeRunner(self.model.cfg, params, mesh, rules,
                                          num_shards * c.slots_per_shard, c.pages_per_shard,
                                          c.page_size, self.counter, self.dtype)
        self.decode_scheduler = DecodeScheduler(num_shards, c.slots_per_shard, c.pages_per_shard,
                                                c.page_size)
        connectors = [self.connector]
        if not spec.colocated and (c.local_prefill_below or not spec.has_prefill):
            # Prefill on the decode mesh itself, between decode steps, with the decode
            # params (replicated over dp): for short prompts (opt-in: the transfer's fixed
            # cost dominates for them) and, in a decode-only process, to re-prefill a
            # request whose transfer failed.
            local_connector = DevicePutConnector()
            connectors.append(local_connector)
            runner = PrefillRunner(self.model.cfg, params, mesh, rules, c.page_size,
                                   self.counter, self.dtype, name="local_prefill")
            buckets = ([b for b in c.buckets if b < c.local_prefill_below] or c.buckets[:1]
                       if spec.has_prefill else c.buckets)
            self.local_scheduler = self._prefill_scheduler(buckets)
            self.local_worker = PrefillWorker(runner, self.local_scheduler, local_connector,
                                              c.page_size, self.counters, local=True)
        self.decode_worker = DecodeWorker(self.decode_runner, self.decode_scheduler, connectors,
                                          self._resubmit, self._resolve, self.counters,
                                          c.pages_per_slot, c.kv_part_timeout_s)

    # ---- public -------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, request: Request) -> Request:
        """Queue a validated request. Raises QueueFull (admission) or RuntimeError (dead)."""
        if self._error is not None:
            raise RuntimeError(f"engine failed: {self._error!r}") from self._error
        if self._stop.is_set():
            raise RuntimeError("engine is shut down")
        with self._lock:
            self._prune()
            waiting = sum(r.state is State.WAITING for r in self._live.values())
            if waiting >= self.config.max_queued:
                raise QueueFull(f"{waiting} requests already wait for prefill "
                                f"(max_queued={self.config.max_queued})")
            if request.request_id in self._live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._live[request.request_id] = request
        self._route(request)
        return request

    def register(self, request: Request) -> None:
        """Decode-only process: announce a request whose KV will arrive through the
        connector (its handoff then resolves to this object, whose events stream)."""
        request.state = State.TRANSFERRING    # it waits for KV prefilled elsewhere
        with self._lock:
            self._prune()
            self._live[request.request_id] = request

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """Abort at once; its slot and pages are freed by the workers' next iteration."""
        with self._lock:
            r = self._live.get(request_id)
        if r is None or not r.abort(reason):
            return False
        self.counters.aborted += 1
        self._wake.set()
        return True

    def is_idle(self) -> bool:
        with self._lock:
            done = all(r.is_final for r in self._live.values())
        return done and (self.decode_worker is None or self.decode_worker.idle)

    def stats(self) -> dict:
        c = self.counters
        slots = self.decode_scheduler.slots if self.decode_scheduler else []
        allocators = self.decode_scheduler.allocators if self.decode_scheduler else []
        return {
            "mesh": str(self.config.mesh),
            "compiled_programs": self.counter.counts(),
            "num_compiled_programs": self.counter.total,
            "prefill_batches": c.prefill_batches,
            "prefill_tokens": c.prefill_tokens,
            "prefill_padded_tokens": c.prefill_padded_tokens,
            "transfers": c.transfers,
            "layerwise_transfers": c.layerwise_transfers,
            "transfer_bytes": c.transfer_bytes,
            "transfer_s": c.transfer_s,
            "decode_steps": c.decode_steps,
            "preemptions": c.preemptions,
            "local_prefills": c.local_prefills,
            "transfer_failures": c.transfer_failures,
            "finished": c.finished,
            "aborted": c.aborted,
            "slots_total": len(slots),
            "slots_active": sum(s is not None for s in slots),
            "pages_total": sum(a.capacity for a in allocators),
            "pages_used": sum(a.num_used for a in allocators),
            "queue_waiting": sum(r.state is State.WAITING for r in list(self._live.values())),
        }

    def shutdown(self, reason: str = "shutdown") -> None:
        """Stop the threads, abort what is still in flight, join. Idempotent."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=60)
        with self._lock:
            live = list(self._live.values())
        for r in live:
            if r.abort(reason):
                self.counters.aborted += 1
        if self.decode_worker is not None:
            self.decode_worker.close()
        self.connector.close()

    def _warmup(self, progress: Callable[[str], None]) -> None:
        """Compile every prefill (batch, length) bucket, every decode context width and
        every insert size before serving, so steady state compiles nothing. Runs before
        the threads start; the decode calls only touch the null page."""
        cfg = self.config
        for worker in (self.prefill_worker, self.local_worker):
            if worker is None:
                continue
            sched = worker.scheduler
            shapes = sorted({(sched.padded_batch(b, t), t) for t in sched.buckets
                             for b in sched.batch_sizes})
            for i, (b, t) in enumerate(shapes):
                progress(f"compiling {worker.runner.name} {i + 1}/{len(shapes)}: "
                         f"batch {b} x {t} tokens")
                args = (np.zeros((b, t), np.int32), np.ones(b, np.int32), SamplingArrays.empty(b))
                if worker.uses_layerwise(t):
                    jax.block_until_ready(worker.runner.run_layerwise(*args, worker.layerwise, []))
                else:
                    worker.runner.run(*args)
        if self.decode_worker is None:
            return
        num_slots = len(self.decode_scheduler.slots)
        widths = sorted({min(1 << (n - 1).bit_length(), cfg.pages_per_slot)
                         for n in range(1, cfg.pages_per_slot + 1)})
        for i, w in enumerate(widths):
            progress(f"compiling decode step {i + 1}/{len(widths)}: {w} pages of context")
            self.decode_runner.step(np.zeros(num_slots, np.int32), np.ones(num_slots, bool),
                                    np.zeros(num_slots, np.int32),
                                    np.zeros((num_slots, w), np.int32), SamplingArrays.empty(num_slots))
        cfg_m = self.model.cfg
        dtype = DTYPES[cfg.dtype]
        for m in widths:
            progress(f"compiling page insert for {m} pages")
            shape = (cfg_m.num_layers, m, cfg.page_size, cfg_m.num_kv_heads, cfg_m.head_dim)
            pages = jax.device_put(jnp.zeros(shape, dtype), self.decode_runner.shard_sharding(0))
            self.decode_runner.insert(0, [0] * m, pages, pages)
        jax.block_until_ready(self.decode_runner.k_pool)

    # ---- threads ------------------------------------------------------------------

    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as e:   # surface, never hang: fail every live request
            self._error = e
            self._stop.set()
            with self._lock:
                live = list(self._live.values())
            for r in live:
                if r.abort(f"failed: {e!r}"):
                    self.counters.aborted += 1
            logging.exception("engine thread %s died; every live request was aborted",
                              threading.current_thread().name)

    def _route(self, request: Request) -> None:
        """To the prefill mesh, or to the decode mesh's local prefill (short prompts,
        or a decode-only process)."""
        local = self.local_worker is not None and (
            self.prefill_worker is None or request.num_tokens < self.config.local_prefill_below)
        (self._local_inbox if local else self._inbox).put(request)
        self._wake.set()

    def _resubmit(self, request: Request) -> None:
        """Preempted, or its transfer failed: prefill it again (prompt + output so far)."""
        self._route(request)

    def _resolve(self, payload) -> Request | None:
        """The request a handoff belongs to: the object itself in one process; across
        processes, the registered mirror (or a new one) built from the wire form."""
        if isinstance(payload, Request):
            return payload
        with self._lock:
            r = self._live.get(payload["request_id"])
            if r is None:
                r = self._live[payload["request_id"]] = Request.from_wire(payload)
        return r

    def _handed_off(self, request: Request) -> None:
        """Prefill-only process: the request now lives on the decode side."""
        with self._lock:
            self._live.pop(request.request_id, None)
        request.events.put(([], "handed_off"))

    def reprefill(self, request_id: str) -> bool:
        """Decode side: a registered request whose KV will not come (its prefill worker
        failed) is prefilled here instead. False if it is not waiting for KV."""
        with self._lock:
            r = self._live.get(request_id)
        if r is None or self.local_worker is None:
            return False
        if r.state is not State.TRANSFERRING or not r.transition(State.WAITING):
            return False
        self.counters.transfer_failures += 1
        self._route(r)
        return True

    @staticmethod
    def _drain(inbox: queue.SimpleQueue, scheduler: PrefillScheduler) -> None:
        while True:
            try:
                r = inbox.get_nowait()
            except queue.Empty:
                return
            if not r.is_final:
                scheduler.add(r)

    def _prefill_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain(self._inbox, self.prefill_scheduler)
            ran, wait = self.prefill_worker.run_batch(time.perf_counter())
            if not ran:
                self._wake.wait(timeout=0.05 if wait is None else max(wait, 1e-4))

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            if self.local_worker is not None:
                self._drain(self._local_inbox, self.local_scheduler)
                self.local_worker.run_batch(time.perf_counter())
            self.decode_worker.iterate(receive_timeout=0.02)
        self.decode_worker.drain()

    def _colocated_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain(self._inbox, self.prefill_scheduler)
            ran, wait = self.prefill_worker.run_batch(time.perf_counter())
            if self.decode_worker.idle and not ran:
                # Nothing to decode: sleep until a request arrives or a bucket is due.
                self._wake.wait(timeout=0.05 if wait is None else max(wait, 1e-4))
            self.decode_worker.iterate(receive_timeout=None)
        self.decode_worker.drain()

    def _prune(self) -> None:
        """Forget final requests (callers hold their own reference)."""
        for k in [k for k, r in self._live.items() if r.is_final]:
            del self._live[k]
