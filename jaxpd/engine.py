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
from models.llama import abstract_params
from sharding import build_meshes, logical_rules, named_shardings
from transfer.connector import Connector
from transfer.device_put import DevicePutConnector


class QueueFull(RuntimeError):
    """Admission control said no: too many requests are waiting."""


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig,
                 connector: Connector | None = None, warmup: bool = False,
                 progress: Callable[[str], None] | None = None):
        self.model, self.config = model, config
        cfg = model.cfg
        self.meshes = build_meshes(config.mesh)
        dtype = DTYPES[config.dtype]
        _, logical = abstract_params(cfg, dtype)
        self.counter = CompileCounter()
        self.counters = Counters()
        prefill_rules = logical_rules(cfg, self.meshes.prefill)
        decode_rules = logical_rules(cfg, self.meshes.decode)
        cast = lambda p: jax.tree.map(lambda a: a.astype(dtype), p)
        prefill_params = jax.device_put(cast(model.params),
                                        named_shardings(logical, self.meshes.prefill, prefill_rules))
        decode_params = jax.device_put(cast(model.params),
                                       named_shardings(logical, self.meshes.decode, decode_rules))
        self.prefill_runner = PrefillRunner(cfg, prefill_params, self.meshes.prefill, prefill_rules,
                                            config.page_size, self.counter, dtype)
        num_shards = config.mesh.decode_dp
        self.decode_runner = DecodeRunner(cfg, decode_params, self.meshes.decode, decode_rules,
                                          num_shards * config.slots_per_shard,
                                          config.pages_per_shard, config.page_size,
                                          self.counter, dtype)
        self.prefill_scheduler = PrefillScheduler(
            config.buckets, config.max_prefill_batch, config.max_prefill_tokens,
            config.bucket_timeout_ms / 1000, config.min_prefill_batch)
        self.decode_scheduler = DecodeScheduler(num_shards, config.slots_per_shard,
                                                config.pages_per_shard, config.page_size)
        self.connector = connector or DevicePutConnector()
        self.prefill_worker = PrefillWorker(self.prefill_runner, self.prefill_scheduler,
                                            self.connector, config.page_size, self.counters)
        connectors = [self.connector]
        self.local_worker = None
        if config.local_prefill_below and not config.mesh.colocated:
            # Short prompts prefill on the decode mesh itself, between decode steps, with
            # the decode params (replicated over dp): no cross-mesh transfer, whose fixed
            # cost dominates for them.
            local_connector = DevicePutConnector()
            connectors.append(local_connector)
            local_runner = PrefillRunner(cfg, decode_params, self.meshes.decode, decode_rules,
                                         config.page_size, self.counter, dtype, name="local_prefill")
            local_buckets = [b for b in config.buckets if b < config.local_prefill_below] or \
                config.buckets[:1]
            self.local_scheduler = PrefillScheduler(
                local_buckets, config.max_prefill_batch, max(config.max_prefill_tokens, local_buckets[-1]),
                config.bucket_timeout_ms / 1000, config.min_prefill_batch)
            self.local_worker = PrefillWorker(local_runner, self.local_scheduler, local_connector,
                                              config.page_size, self.counters, local=True)
        self.decode_worker = DecodeWorker(self.decode_runner, self.decode_scheduler, connectors,
                                          self._resubmit, self.counters, config.pages_per_slot)
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
        if config.mesh.colocated:
            self._threads = [threading.Thread(target=self._guard, args=(self._colocated_loop,),
                                              name="jaxpd-engine", daemon=True)]
        else:
            self._threads = [
                threading.Thread(target=self._guard, args=(self._prefill_loop,),
                                 name="jaxpd-prefill", daemon=True),
                threading.Thread(target=self._guard, args=(self._decode_loop,),
                                 name="jaxpd-decode", daemon=True)]
        for t in self._threads:
            t.start()

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
        self._inbox.put(request)
        self._wake.set()
        return request

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
            return (all(r.is_final for r in self._live.values()) and self.decode_worker.idle
                    and self.decode_scheduler.num_active() == 0)

    def stats(self) -> dict:
        c = self.counters
        sched = self.decode_scheduler
        return {
            "mesh": str(self.config.mesh),
            "compiled_programs": self.counter.counts(),
            "num_compiled_programs": self.counter.total,
            "prefill_batches": c.prefill_batches,
            "prefill_tokens": c.prefill_tokens,
            "prefill_padded_tokens": c.prefill_padded_tokens,
            "transfers": c.transfers,
            "transfer_bytes": c.transfer_bytes,
            "transfer_s": c.transfer_s,
            "decode_steps": c.decode_steps,
            "preemptions": c.preemptions,
            "local_prefills": c.local_prefills,
            "finished": c.finished,
            "aborted": c.aborted,
            "slots_total": len(sched.slots),
            "slots_active": sched.num_active(),
            "pages_total": sum(a.capacity for a in sched.allocators),
            "pages_used": sum(a.num_used for a in sched.allocators),
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
        self.connector.close()

    def _warmup(self, progress: Callable[[str], None]) -> None:
        """Compile every prefill (batch, length) bucket, every decode context width and
        every insert size before serving, so steady state compiles nothing. Runs before
        the threads start; the decode calls only touch the null page."""
        cfg, sched = self.config, self.prefill_scheduler
        shapes = sorted({(sched.padded_batch(b, t), t) for t in cfg.buckets
                         for b in sched.batch_sizes})
        for i, (b, t) in enumerate(shapes):
            progress(f"compiling prefill {i + 1}/{len(shapes)}: batch {b} x {t} tokens")
            self.prefill_runner.run(np.zeros((b, t), np.int32), np.ones(b, np.int32),
                                    SamplingArrays.empty(b))
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

    def _resubmit(self, request: Request) -> None:
        self._inbox.put(request)
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                r = self._inbox.get_nowait()
            except queue.Empty:
                return
            if r.is_final:
                continue
            if self.local_worker is not None and r.num_tokens < self.config.local_prefill_below:
                self._local_inbox.put(r)
            else:
                self.prefill_scheduler.add(r)

    def _drain_local_inbox(self) -> None:
        while True:
            try:
                r = self._local_inbox.get_nowait()
            except queue.Empty:
                return
            if not r.is_final:
                self.local_scheduler.add(r)

    def _prefill_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            ran, wait = self.prefill_worker.run_batch(time.perf_counter())
            if not ran:
                self._wake.wait(timeout=0.05 if wait is None else max(wait, 1e-4))

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            if self.local_worker is not None:
                self._drain_local_inbox()
                self.local_worker.run_batch(time.perf_counter())
            self.decode_worker.iterate(receive_timeout=0.02)
        self.decode_worker.drain()

    def _colocated_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
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
