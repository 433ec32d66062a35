"""The engine: meshes, runners, loops, and the threads that drive them.

Threads (named, few; a dead one aborts every live request with its error and makes
`submit` raise, never a silent hang):
  disaggregated  jaxpd-prefill  prefill inbox -> PrefillLoop (prefill mesh) -> KVSender
                 jaxpd-decode   KVReceiver -> InboundQueue -> DecodeLoop (decode mesh)
                                -> request events; plus the decode mesh's own
                                PrefillLoop (short prompts, re-prefills) between steps
  colocated      jaxpd-engine   a due prefill batch, then one decode step, in one loop
  transfers      jaxpd-transfer a small pool: pages move into reserved slots here
                 (in one process `send` has already copied them onto the decode
                 mesh, before the next prefill batch: `transfer.device_put`)
Queues: the prefill inboxes of `Requests` (bounded by `max_queued` at submit) and the
connector's bounded handoff queue (prefill -> decode: backpressure on prefill).

Layout: `Topology.of(config)` decides once which meshes, loops and threads exist and
where a prompt is prefilled (`Routing` follows it); what a mesh spec builds is one
`Phases` object the engine holds, so an elastic re-split swaps it whole.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from concurrent import futures
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpd.config import (EngineConfig, default_kv_cache_memory, kv_pools,
                          resolve_attention_impl, resolve_context)
from jaxpd.engine.loops.decode_loop import DecodeLoop
from jaxpd.engine.loops.extend_loop import ExtendLoop
from jaxpd.engine.kv.host_store import HostStore
from jaxpd.engine.kv.host_tier import HostTier
from jaxpd.engine.multihost.plan_channel import Follower, PlanChannel
from jaxpd.engine.multihost.decode import lead, replay_for
from jaxpd.engine.scheduling.page_allocator import CacheJournal, prefix_root
from jaxpd.engine.kv.paged_prefill import PrefillCache, cache_pages
from jaxpd.engine.loops.prefill_loop import PrefillLoop
from jaxpd.engine.scheduling.registry import Limits, Requests
from jaxpd.engine.scheduling.inboxes import Routing
from jaxpd.engine.programs.prefill_runner import PrefillRunner
from jaxpd.engine.programs.decode_runner import CompileCounter, DecodeRunner
from jaxpd.engine.scheduling.scheduler import DecodeScheduler, PrefillScheduler
from jaxpd.engine.topology import Topology
from jaxpd.engine.compile.executable_cache import KeptExecutables
from jaxpd.engine.compile.warmup import warm_up
from jaxpd import host_memory
from jaxpd.models.checkpoint import LoadedModel
from jaxpd.models.fingerprint import model_fingerprint, short
from jaxpd.models.hf_io import DTYPES
from jaxpd.engine.programs.placement import place_params
from jaxpd.models.llama import layer_groups
from jaxpd.request import Request, State
from jaxpd.sharding import Meshes, build_meshes, replicated_over_tp
from jaxpd.stats import EngineStats, StatsCounter
from jaxpd.transfer.compression import CompressingReceiver, CompressingSender
from jaxpd.transfer.connector import Connector, KVReceiver, KVSender
from jaxpd.transfer.device_put import DevicePutConnector
from jaxpd.transfer.inbound import HandoffSpec, InboundQueue

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Phases:
    """What one mesh spec builds: its meshes and the runners, schedulers and loops on
    them. The engine holds one and reads these through its own attributes
    (`engine.decode_loop` is `engine.phases.decode_loop`); an elastic re-split builds
    another beside it and swaps the whole object (`engine.elastic`)."""
    config: EngineConfig
    model: LoadedModel
    meshes: Meshes
    topology: Topology
    prefill_runner: PrefillRunner | None = None
    prefill_scheduler: PrefillScheduler | None = None
    prefill_cache: PrefillCache | None = None
    prefill_loop: PrefillLoop | None = None
    local_scheduler: PrefillScheduler | None = None
    local_loop: PrefillLoop | None = None
    decode_runner: DecodeRunner | None = None
    decode_scheduler: DecodeScheduler | None = None
    decode_loop: DecodeLoop | None = None
    host_tier: HostTier | None = None


_PHASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Phases))

# The engines of this process that serve (started, not shut down). jax's caches of
# traced and compiled programs are the process's, and they hold every program an
# engine ran after its runners are gone: the last engine to stop clears them (sooner,
# the others would trace and compile again).
_serving: weakref.WeakSet = weakref.WeakSet()
_serving_lock = threading.Lock()


class Engine:
    """Runs whichever phases this process's mesh spec has: both (one process, or
    colocated), prefill only, or decode only (multi-process deployments: `connector`
    is then the cross-process sender or receiver, and payloads travel in wire form)."""

    def __init__(self, model: LoadedModel, config: EngineConfig,
                 connector: Connector | KVSender | KVReceiver | None = None,
                 warmup: bool = False, progress: Callable[[str], None] | None = None,
                 plan: PlanChannel | None = None, lower_for: str | None = None):
        """`plan`: this one-role mesh spans processes (`engine.multihost`): its leader
        publishes every program it dispatches; a follower starts no thread (`follow`).
        `lower_for`: a platform ("tpu", "cuda", "cpu") whose programs this engine builds
        to be lowered, not run (`jaxpd.export`, on a mesh of stand-in devices of the
        same shape): attention resolves for that platform, and nothing is warmed up or
        started."""
        if lower_for is not None and warmup:
            raise ValueError("an engine built to be lowered (lower_for) runs no warm-up")
        if not config.resolved:      # built directly: the same rule as `LLM`'s
            config = resolve_context(config, model.cfg, default_kv_cache_memory(
                jax.devices()[0], kv_pools(config, plan is not None)))
        self.model, self.lower_for = model, lower_for
        self._final_stats: EngineStats | None = None     # set by `shutdown`
        spec = config.mesh
        if plan is not None and (spec.has_prefill == spec.has_decode or
                                 config.enable_prefix_caching):
            raise ValueError("a mesh across processes is one role's (prefill=P or decode=DxT), "
                             "without prefix caching (not supported there yet)")
        self.plan, self._told_followers = plan, False
        self.is_follower = plan is not None and not plan.group.is_leader
        # Every layout decision, once; an elastic re-split keeps it (both meshes, one
        # process, no prefix cache, whatever the sizes).
        self.topology = topology = Topology.of(config, multi_process=plan is not None)
        self.prefix_root = self._prefix_root(config)
        # What this engine's caches hold, for the router (a worker's heartbeat).
        self.cache_journal = CacheJournal(self.prefix_root) if self.prefix_root else None
        self.dtype = DTYPES[config.dtype]
        # What makes this engine's KV usable by another: every handoff carries it and
        # a decode pool refuses a handoff of another (`models.fingerprint`).
        started = time.perf_counter()
        self.fingerprint = model_fingerprint(model.path, model.cfg, config.dtype,
                                             config.page_size, config.kv_transfer_dtype,
                                             quantization=model.quantization,
                                             activations=config.quant_activations)
        _log.info("model fingerprint %s (%s, %.2f s)", short(self.fingerprint), model.path,
                  time.perf_counter() - started)
        if plan is not None:
            plan.check_model(self.fingerprint)     # a follower of other weights refuses
        self.counter = CompileCounter()
        self.counters = StatsCounter()
        self.connector = connector or DevicePutConnector()
        routing = Routing(
            has_prefill=topology.prefill_mesh, has_decode=topology.decode_mesh,
            local_prefill=topology.local_prefill,
            local_prefill_below=config.local_prefill_below, extend_all=topology.extend_all,
            cached_tokens=self._cached_tokens if topology.decode_caching else None,
            extend_ready=self._extend_ready, extend_below=config.prefix_extend_below,
            page_size=config.page_size)
        self.requests = Requests(
            self.counters, config.max_queued,
            Limits(model.cfg.vocab_size, config.max_prompt_len, config.max_model_len),
            routing, remote_decode=not topology.decode_mesh)
        self._transfers = futures.ThreadPoolExecutor(4, thread_name_prefix="jaxpd-transfer")
        self.phases = self.build_phases(config)
        if topology.in_process_handoffs and isinstance(self.connector, DevicePutConnector):
            self.connector.stage_on(self._staging_sharding())
        # Where warm-up keeps its executables, and loads them from
        # (`engine.compile.executable_cache`).
        self.kept: KeptExecutables | None = None
        if warmup and not self.is_follower:     # a follower replays the leader's warm-up
            self.kept = KeptExecutables.for_engine(self.fingerprint, config)
            warm_up(self.phases, progress or (lambda msg: None),
                    spans_processes=self.plan is not None, keep=self.kept)
            # What its compiles freed would stay in the C heap, counted as this
            # process's, for as long as it serves.
            host_memory.give_back()
        self.warmed = warmup
        self.prepared_splits: dict = {}        # an elastic split's (`engine.elastic`)
        self._stop = threading.Event()
        self._paused = threading.Event()      # an elastic re-split holds the threads
        self.resplit_lock, self.lifecycle_lock = threading.Lock(), threading.Lock()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        if lower_for is None:
            with _serving_lock:
                _serving.add(self)
            self.resume_threads()

    def __getattr__(self, name: str):
        """The current split's meshes, runners, schedulers, loops and config (`Phases`)."""
        phases = self.__dict__.get("phases")
        if phases is not None and name in _PHASE_FIELDS:
            return getattr(phases, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def build_phases(self, config: EngineConfig,
                     inbound: list[InboundQueue] | None = None) -> Phases:
        """Meshes, weights, pools, runners and loops for `config`'s mesh spec, sharing
        this engine's requests, connector, counters and transfer threads; `inbound`: the
        decode loop's handoff queues (an elastic split keeps the old ones)."""
        topology = self.topology
        phases = Phases(config, self.model, build_meshes(config.mesh), topology)
        if topology.prefill_loop:
            self._build_prefill(phases)
        if topology.decode_mesh:
            self._build_decode(phases, inbound)
        return phases

    def resume_threads(self) -> None:
        """Start this mesh's loop threads (again, after `pause_threads`)."""
        self._paused.clear()
        runs = {"jaxpd-engine": self._run_colocated, "jaxpd-prefill": self._run_prefill,
                "jaxpd-decode": self._run_decode}
        names = [] if self.is_follower or self._stop.is_set() else self.topology.threads
        self._threads = [threading.Thread(target=self._guard, args=(runs[name],), name=name,
                                          daemon=True) for name in names]
        for t in self._threads:
            t.start()

    def pause_threads(self) -> bool:
        """Stop the loop threads at a batch or step boundary, nothing aborted (an
        elastic re-split); False if the engine is shut down."""
        self._paused.set()
        self.requests.wake.set()
        for t in self._threads:
            t.join()
        return not self._stop.is_set()

    def _serving(self) -> bool:
        return not (self._stop.is_set() or self._paused.is_set())

    def _params_on(self, c: EngineConfig, mesh, fuse: bool, prefill_only: bool = False,
                   scan: bool = False, keep_quantized: bool = False):
        """(params on `mesh`, its logical rules, whether fused: `engine.programs.placement`; the
        attention kernels for its devices: `resolve_attention_impl`). A CPU mesh that
        only prefills gets quantized weights as float (a prompt's many rows are
        compute-bound, and XLA:CPU's product of the jnp form unpacks every weight on
        every call) unless `keep_quantized` (its prompts take `_prefill_product`).
        `scan`: runs of equal layers stacked, to be scanned."""
        platform = self.lower_for or mesh.devices.flat[0].platform
        whole = replicated_over_tp(mesh, **self.model.cfg.logical_dims())
        if whole:
            # Replicated by design (`sharding.rules`): it serves, but the user asked for
            # a split these dimensions do not get.
            _log.warning("mesh %s: tp=%d does not divide %s: each tp device holds and "
                         "computes them whole", dict(mesh.shape), mesh.shape["tp"],
                         ", ".join(f"{k}={v}" for k, v in whole.items()))
        params = self.model.params
        if prefill_only and platform == "cpu" and not keep_quantized:
            from jaxpd.models import quant
            params = quant.dequantize_params(params)
        return (*place_params(self.model.cfg, params, mesh, self.dtype, fuse=fuse,
                              scan=scan),
                resolve_attention_impl(c.attention_impl, platform, c.attention_interpret,
                                       c.dtype, self.model.cfg.head_dim))

    def _quant_matmul(self, c: EngineConfig, params, mesh):
        """The native product of quantized weights for a mesh where it serves: CPU
        devices, float32, weights whole on each device (no tp: the kernel is opaque to
        GSPMD), the kernel built; with int8 activations when `quant_activations` says
        so. None otherwise (the jnp form everywhere)."""
        from jaxpd.models import quant

        if not quant.any_quantized(params):
            return None
        if ((self.lower_for or mesh.devices.flat[0].platform) != "cpu"
                or c.dtype != "float32"
                or mesh.shape.get("tp", 1) != 1 or not quant.native_available()):
            return None
        return quant.native_dot if c.quant_activations == "int8" else quant.native_matmul

    def _prefill_product(self, c: EngineConfig, mesh, layerwise: bool):
        """The product a prefill mesh's prompts take its quantized weights through, or
        None (its weights are float: `_params_on`): with int8 activations, where
        `_quant_matmul` serves, for a model without experts (their grouped products
        have no native prompt form) and a prefill that is not layer-wise (its middle
        programs take the layers' params as arguments, float)."""
        if c.quant_activations != "int8" or layerwise or self.model.cfg.is_moe:
            return None
        return self._quant_matmul(c, self.model.params, mesh)

    def _prefill_scheduler(self, c: EngineConfig, buckets: list[int],
                           chunked: bool = False) -> PrefillScheduler:
        return PrefillScheduler(buckets, c.max_prefill_batch, max(c.max_prefill_tokens, buckets[-1]),
                                c.bucket_timeout_ms / 1000, c.min_prefill_batch, chunked)

    def _page_shape(self, c: EngineConfig) -> tuple[int, int, int]:
        return (c.page_size, self.model.cfg.num_kv_heads, self.model.cfg.head_dim)

    def _handoff_spec(self, c: EngineConfig, compressed: bool,
                      remote: bool = False) -> HandoffSpec:
        """What a handoff into this decode pool must announce (`transfer.inbound`); one
        from another process (`remote`) must also name this engine's fingerprint."""
        page = self._page_shape(c)
        return HandoffSpec(
            num_layers=self.model.cfg.num_layers, page_size=c.page_size,
            page_shape=(page[0] * page[1] * page[2] + 4,) if compressed else page,
            dtype="uint8" if compressed else c.dtype, vocab_size=self.model.cfg.vocab_size,
            max_model_len=c.max_model_len,
            max_pages=min(c.pages_per_slot, c.pages_per_shard - 1),
            fingerprint=self.fingerprint if remote else "")

    def _staging_sharding(self) -> NamedSharding:
        """Where a `DevicePutConnector` copies each handoff's pages in `send`, before the
        next prefill batch (`transfer.device_put`): dp shard 0 of the decode mesh, in the
        layout pages travel in (packed bytes replicated: `CompressingReceiver.place`)."""
        pages = self.decode_runner.shard_sharding(0)
        if self.config.kv_transfer_dtype is not None:
            return NamedSharding(pages.mesh, PartitionSpec())
        return pages

    def _build_prefill(self, p: Phases) -> None:
        c, mesh, topology = p.config, p.meshes.prefill, p.topology
        product = self._prefill_product(c, mesh, topology.layerwise)
        params, rules, fused, attention = self._params_on(c, mesh, fuse=False,
                                                          prefill_only=True,
                                                          scan=c.scan_layers == "all"
                                                          and not topology.layerwise,
                                                          keep_quantized=product is not None)
        p.prefill_runner = lead(PrefillRunner(
            self.model.cfg, params, mesh, rules, c.page_size, self.counter, self.dtype,
            fused=fused, gather_pages=bool(self.plan and not self.plan.offers),
            attention_impl=attention, quant_matmul=product), self.plan)
        chunked = topology.paged_prefill and c.buckets[-1] > c.prefill_chunk_tokens
        buckets = [b for b in c.buckets if b <= c.prefill_chunk_tokens] if chunked else c.buckets
        p.prefill_scheduler = self._prefill_scheduler(c, buckets, chunked)
        sender = self.connector
        if c.kv_transfer_dtype is not None:
            sender = CompressingSender(sender, c.kv_transfer_dtype)
        groups = layer_groups(self.model.cfg.num_layers, c.layerwise_parts) \
            if topology.layerwise else None
        caching = topology.prefill_caching
        p.prefill_cache = PrefillCache(
            self.model.cfg, params, mesh, rules, cache_pages(c, p.prefill_scheduler, chunked,
                                                             caching),
            c.page_size, c.pages_per_slot, self.prefix_root if caching else None,
            self.counter, self.dtype, fused=fused, journal=self.cache_journal,
            attention_impl=attention, quant_matmul=product
        ) if topology.paged_prefill else None
        if caching and p.prefill_cache is not None and c.prefill_host_cache_gb > 0:
            # Advertised like the decode side's: the router ranks prefill workers by the
            # tokens each would compute, counting what its host tier can restore.
            p.prefill_cache.attach_host(HostTier(
                p.prefill_cache, HostStore(int(c.prefill_host_cache_gb * 2**30),
                                           self.cache_journal),
                c.pages_per_slot, self.counters, counts="prefill_host_tier"))
        p.prefill_loop = PrefillLoop(p.prefill_runner, p.prefill_scheduler, sender,
                                     self.requests, self.requests.prefill_inbox, c.page_size,
                                     self.counters, layerwise=groups,
                                     layerwise_min_tokens=c.layerwise_min_tokens,
                                     handoff_wait_s=c.handoff_wait_ms / 1000,
                                     cache=p.prefill_cache,
                                     chunk_tokens=c.prefill_chunk_tokens if chunked else None,
                                     fingerprint=self.fingerprint,
                                     hold_first_token=topology.decode_mesh)

    def _build_decode(self, p: Phases, inbound: list[InboundQueue] | None) -> None:
        c, mesh, spec, topology = p.config, p.meshes.decode, p.config.mesh, p.topology
        # "auto" scans where the native quantized product reads every layer's weights
        # in place in the stack; elsewhere XLA:CPU would copy a float layer out of it
        # in every step.
        scan = c.scan_layers == "all" or (
            c.scan_layers == "auto" and self._quant_matmul(c, self.model.params, mesh) is not None)
        params, rules, fused, attention = self._params_on(c, mesh, fuse=True, scan=scan)
        p.decode_runner = runner = lead(DecodeRunner(
            self.model.cfg, params, mesh, rules, spec.decode_dp * c.slots_per_shard,
            c.pages_per_shard, c.page_size, self.counter, self.dtype, fused=fused,
            attention_impl=attention, attention_interpret=c.attention_interpret,
            quant_matmul=self._quant_matmul(c, params, mesh)), self.plan)
        if topology.decode_caching and c.kv_host_cache_gb > 0:
            p.host_tier = HostTier(runner, HostStore(int(c.kv_host_cache_gb * 2**30),
                                                     self.cache_journal),
                                   min(c.pages_per_slot, c.pages_per_shard - 1),
                                   self.counters)
        p.decode_scheduler = scheduler = DecodeScheduler(
            spec.decode_dp, c.slots_per_shard, c.pages_per_shard, c.page_size,
            self.prefix_root if topology.decode_caching else None, self.cache_journal,
            on_evict=p.host_tier.evicted if p.host_tier is not None else None)
        queues = inbound if inbound is not None else [self._inbound_queue(c)]
        if topology.local_loop:
            # Prefill on the decode mesh itself, between decode steps, with the decode
            # params (replicated over dp): for short prompts (opt-in: the transfer's fixed
            # cost dominates for them) and, in a decode-only process, to re-prefill a
            # request whose transfer failed. Its pages are already on this mesh.
            pipe = DevicePutConnector()
            queues = queues + [InboundQueue(pipe, self._transfers, c.kv_part_timeout_s,
                                            self._handoff_spec(c, compressed=False),
                                            counted=False)]
            local = lead(PrefillRunner(
                self.model.cfg, params, mesh, rules, c.page_size, self.counter, self.dtype,
                name="local_prefill", fused=fused, gather_pages=self.plan is not None,
                attention_impl=attention), self.plan)
            buckets = ([b for b in c.buckets if b < c.local_prefill_below] or c.buckets[:1]
                       if spec.has_prefill else c.buckets)
            p.local_scheduler = self._prefill_scheduler(c, buckets)
            p.local_loop = PrefillLoop(local, p.local_scheduler, pipe, self.requests,
                                       self.requests.local_inbox, c.page_size, self.counters,
                                       on_decode_mesh=True, hold_first_token=True)
        extend = None
        if topology.extend_loop:
            every = topology.extend_all
            extend = ExtendLoop(
                runner, scheduler, self.requests.extend_inbox, self.counters, c.buckets,
                c.max_prefill_batch, c.max_prefill_tokens, c.pages_per_slot,
                c.decode_context_step,
                expected_below=None if every else max(c.prefix_extend_below, c.local_prefill_below),
                expects_fresh=every or c.local_prefill_below > 0,
                chunk_tokens=c.chunked_prefill_tokens if topology.chunked_in_slots else None,
                host=p.host_tier,
                reroute=self.requests.prefill_instead if topology.prefill_loop else None,
                prefix_in_place=runner.extend_kernel == "native")
        p.decode_loop = DecodeLoop(runner, scheduler, queues, self.requests, self.counters,
                                   c.pages_per_slot, c.decode_context_step,
                                   by_length=attention != "reference", extend=extend)

    def _inbound_queue(self, c: EngineConfig) -> InboundQueue:
        """The decode loop's queue of handoffs from the connector (a decode-only process:
        from another process, checked against this engine's fingerprint)."""
        receiver, remote = self.connector, not self.topology.prefill_mesh
        expect_model = getattr(receiver, "expect_model", None)
        if expect_model is not None and remote:
            expect_model(self.fingerprint)      # refused before its pages are taken
        if c.kv_transfer_dtype is not None:
            receiver = CompressingReceiver(receiver, c.kv_transfer_dtype, self._page_shape(c),
                                           c.dtype)
        return InboundQueue(receiver, self._transfers, c.kv_part_timeout_s,
                            self._handoff_spec(c, c.kv_transfer_dtype is not None,
                                               remote=remote),
                            remote=remote)

    def _prefix_root(self, config: EngineConfig) -> bytes | None:
        """Roots the page hashes (`page_allocator.prefix_root`); None with no cache."""
        if not (self.topology.decode_caching or self.topology.prefill_caching):
            return None
        return prefix_root(self.model.cfg, config.dtype, config.page_size)

    def _cached_tokens(self, request: Request) -> tuple[int, int]:
        """Tokens of `request` cached on its best decode shard: (in the pool, in the
        pool or then the host tier) (a hint: read from the submitting thread while the
        decode thread may change the cache)."""
        sched = self.decode_scheduler
        if sched is None:
            return 0, 0
        hashes = sched.hashes(request.prefill_ids[:request.num_tokens - 1])
        in_pool, restorable = 0, 0
        for a in sched.allocators:
            n = len(a.cached_prefix(hashes))
            in_pool = max(in_pool, n)
            if self.host_tier is not None:
                n += self.host_tier.restorable(hashes[n:])
            restorable = max(restorable, n)
        return in_pool * sched.page_size, restorable * sched.page_size

    def _extend_ready(self, new_tokens: int, cached_tokens: int) -> bool:
        """Whether the decode mesh's extend loop runs such a rest on compiled programs
        (`ExtendLoop.ready_for`; False without one)."""
        loop = self.decode_loop
        extend = loop.extend if loop is not None else None
        return extend is not None and extend.ready_for(new_tokens, cached_tokens)

    # ---- public -------------------------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """What killed an engine thread, if one died."""
        return self._error

    def new_request_id(self) -> str:
        return self.requests.new_id()

    def submit(self, request: Request) -> Request:
        """Queue a validated request. Raises QueueFull (admission) or RuntimeError (dead)."""
        if self._error is not None:
            raise RuntimeError(f"engine failed: {self._error!r}") from self._error
        if self._stop.is_set():
            raise RuntimeError("engine is shut down")
        request.watch_stop_strings(self.model.tokenizer)
        self.requests.submit(request)
        error = self._error
        if error is not None:    # failed meanwhile: `fail`'s abort_all may have missed it
            self.requests.abort(request.request_id, f"failed: {error!r}")
        return request

    def register(self, request: Request) -> None:
        """Decode-only process: announce a request (state TRANSFERRING) whose KV will
        arrive through the connector; its handoff then resolves to this object."""
        request.watch_stop_strings(self.model.tokenizer)
        self.requests.register(request)

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        """Abort at once; its slot and pages are freed by the loops' next iteration."""
        return self.requests.abort(request_id, reason)

    def reprefill(self, request_id: str) -> bool:
        """Decode side: a registered request whose KV will not come (its prefill worker
        failed) is prefilled here instead. False if it is not waiting for KV."""
        r = self.requests.get(request_id)
        if r is None or not self.topology.local_prefill or r.state is not State.TRANSFERRING:
            return False
        if not self.requests.resubmit(r):
            return False
        self.counters.add(transfer_failures=1)
        return True

    def is_idle(self) -> bool:
        return self.requests.all_final() and (self.decode_loop is None or self.decode_loop.idle) \
            and not (self.prefill_loop and self.prefill_loop.busy)

    def stats(self) -> EngineStats:
        """The engine's counts now; after `shutdown`, as they stood when it stopped."""
        if self._final_stats is not None:
            return self._final_stats
        spec = self.config.mesh
        slots = self.decode_scheduler.slots if self.decode_scheduler else []
        allocators = self.decode_scheduler.allocators if self.decode_scheduler else []
        counts = self.counters.snapshot()
        for name, n in self.connector.counts().items():
            counts[name] += n
        cache = self.prefill_cache.allocator if self.prefill_cache is not None else None
        counts["prefix_evictions"] = sum(a.num_evictions for a in allocators) + (
            cache.num_evictions if cache is not None else 0)
        host = self.host_tier.store if self.host_tier is not None else None
        prefill_tier = self.prefill_cache.host if self.prefill_cache is not None else None
        prefill_host = prefill_tier.store if prefill_tier is not None else None
        counts["host_tier_evicted_pages"] = host.num_evicted if host is not None else 0
        counts["prefill_host_tier_evicted_pages"] = \
            prefill_host.num_evicted if prefill_host is not None else 0
        return EngineStats(
            mesh=str(self.config.mesh), compiled_programs=self.counter.counts(),
            num_compiled_programs=self.counter.total, **counts,
            slots_total=len(slots), slots_active=sum(s is not None for s in slots),
            pages_total=sum(a.capacity for a in allocators),
            pages_used=sum(a.num_used for a in allocators),
            pages_cached=sum(a.num_cached_free for a in allocators),
            prefill_pages_cached=cache.num_cached_free if cache is not None else 0,
            host_tier_pages=len(host) if host is not None else 0,
            host_tier_bytes=host.num_bytes if host is not None else 0,
            prefill_host_tier_pages=len(prefill_host) if prefill_host is not None else 0,
            prefill_host_tier_bytes=prefill_host.num_bytes if prefill_host is not None else 0,
            queue_waiting=self.requests.num_waiting(), prefill_devices=spec.prefill_tp,
            decode_devices=spec.decode_dp * spec.decode_tp)

    def follow(self, follower: Follower, stop: threading.Event) -> str:
        """A follower's life: replay the leader's programs (`multihost.Follower`)."""
        if not self.is_follower:
            raise RuntimeError("follow() is for a follower process of a multi-process mesh")
        return follower.run(replay_for(self), stop)

    def shutdown(self, reason: str = "shutdown", wait_for_compiles: bool = True) -> None:
        """Stop the threads, abort what is in flight, join; a leader stops its followers.
        `wait_for_compiles` False: a background compile in progress is left running
        (for a process about to end with `os._exit`; see `BackgroundCompiler.close`)."""
        with self.lifecycle_lock:     # not halfway through a re-split's swap
            self._stop.set()
        self.requests.wake.set()
        for t in self._threads:
            t.join(timeout=60)
        if self.plan is not None and not self.is_follower and not self._told_followers and \
                not any(t.is_alive() for t in self._threads):
            self._told_followers = True
            self.plan.publish({"op": "stop"})
        self.requests.abort_all(reason)
        self.prepared_splits.clear()
        for x in (self.prefill_cache, self.decode_runner):   # their background compiles
            close = getattr(x, "close", None)
            if close is not None:
                close(120.0 if wait_for_compiles else 0.0)
        # Transfer threads still placing end within their connector's timeout.
        self._transfers.shutdown(wait=True, cancel_futures=True)
        self.connector.close()
        self._release()

    def _release(self) -> None:
        """Give back what a stopped engine holds: its pools, params, executables and
        compile threads' results go with the runners, caches and loops that own them,
        and the weights with the model; what `stats` reports is kept as it stands. The
        engine sits in reference cycles (its bound methods are `Routing`'s callbacks,
        its runners' programs point back at their runners), so dropping the references
        and the callbacks here, not waiting for the collector, is what frees them. The last engine of the
        process to stop clears jax's caches (`_serving`), and `host_memory.give_back`
        then hands the freed heap back to the OS. Idempotent."""
        if self._final_stats is not None:
            return
        if any(t.is_alive() for t in self._threads):
            _log.warning("an engine thread did not stop: its runners and pools are kept")
            return
        self._final_stats = self.stats()
        old = self.phases
        # The schedulers (plain Python, their books as they stood) stay for callers
        # that read them after the stop; what holds device memory goes.
        self.phases = Phases(old.config, dataclasses.replace(self.model, params={}),
                             old.meshes, old.topology,
                             prefill_scheduler=old.prefill_scheduler,
                             local_scheduler=old.local_scheduler,
                             decode_scheduler=old.decode_scheduler)
        self.model = self.phases.model
        self.kept = None
        self.prepared_splits.clear()
        if isinstance(self.connector, DevicePutConnector):
            self.connector.stage_on(None)
        # Routing's callbacks are this engine's bound methods: the last cycle through
        # it. Nothing routes after the stop (`submit` refuses first).
        routing = self.requests.routing
        routing.cached_tokens, routing.extend_ready = None, lambda new, cached: False
        del old
        with _serving_lock:
            _serving.discard(self)
            if not _serving:
                jax.clear_caches()
        host_memory.give_back()

    # ---- threads ------------------------------------------------------------------

    def _guard(self, loop) -> None:
        try:
            loop()
        except BaseException as e:   # surface, never hang: fail every live request
            self.fail(e)
            logging.exception("engine thread %s died; every live request was aborted",
                              threading.current_thread().name)

    def fail(self, error: BaseException) -> None:
        """The engine cannot serve: stop, and abort every live request with `error` (a
        mesh across processes: its `plan.on_failure` first, which may end the process)."""
        if self.plan is not None and self.plan.on_failure is not None:
            self.plan.on_failure(error)
        self._error = error
        self._stop.set()
        self.requests.abort_all(f"failed: {error!r}")

    def _run_prefill(self) -> None:
        wake = self.requests.wake
        while self._serving():
            wake.clear()
            ran, wait = self.prefill_loop.run_once(time.perf_counter())
            if not ran:
                wake.wait(timeout=0.05 if wait is None else max(wait, 1e-4))

    def _run_decode(self) -> None:
        while self._serving():
            if self.local_loop is not None:
                self.local_loop.run_once(time.perf_counter())
            self.decode_loop.iterate(receive_timeout=0.02)
        self.decode_loop.finish_in_flight()

    def _run_colocated(self) -> None:
        wake = self.requests.wake
        while self._serving():
            wake.clear()
            ran, wait = (self.prefill_loop.run_once(time.perf_counter())
                         if self.prefill_loop is not None else (False, None))
            if self.decode_loop.idle and not ran:
                # Nothing to decode: sleep until a request arrives or a bucket is due.
                wake.wait(timeout=0.05 if wait is None else max(wait, 1e-4))
            self.decode_loop.iterate(receive_timeout=None)
        self.decode_loop.finish_in_flight()
