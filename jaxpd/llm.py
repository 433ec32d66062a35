"""The user-facing API: `LLM` (vLLM-like) and the one-shot `generate`."""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import jax

from jaxpd import host_memory, kv_budget
from jaxpd.config import (EngineConfig, default_kv_cache_memory, kv_page_bytes, kv_pools,
                          prebuild_native, resolve_context, resolve_dtype)
from jaxpd.engine import elastic
from jaxpd.engine.engine import Engine
from jaxpd.engine.programs.placement import role_shardings
from jaxpd import xla_cache
from jaxpd.frontend import Frontend
from jaxpd.model_registry import resolve_model
from jaxpd.outputs import CompletionOutput
from jaxpd.request import Request
from jaxpd.sampling_params import SamplingParams
from jaxpd.stats import EngineStats
from jaxpd.models import checkpoint
from jaxpd.sharding.cpu_devices import (cpu_devices_needed, ensure_cpu_devices,
                                        say_if_oversubscribed)
from jaxpd.sharding.spec import AUTO, auto_mesh
from jaxpd.transfer.connector import Connector, KVReceiver, KVSender

_log = logging.getLogger("jaxpd.llm")


def _kv_budget(asked: EngineConfig, kv_cache_memory: int | str | None,
               multi_process: bool) -> tuple[int | None, str, int]:
    """(bytes per pool, where that came from, pools) for `asked` (`jaxpd.kv_budget`):
    `kv_cache_memory` parsed and checked against the host's available memory, or the
    default share of it; None bytes when `pages_per_shard` is given instead. ValueError
    naming the field for a budget that is not a size, or whose pools exceed the host's
    available memory."""
    budget = None if kv_cache_memory is None else \
        kv_budget.parse_kv_cache_memory(kv_cache_memory)
    pools = kv_pools(asked, multi_process)
    if asked.pages_per_shard is not None:
        if budget is not None:
            raise ValueError("give kv_cache_memory or pages_per_shard, not both "
                             "(kv_cache_memory sets pages_per_shard)")
        return None, "pages_per_shard", pools
    device = jax.devices()[0]
    available = host_memory.available_bytes() if device.platform == "cpu" else None
    if budget is not None:
        if not multi_process:       # a mesh across processes holds a part of them here
            kv_budget.check_fits(budget, pools, available)
        return budget, f"kv_cache_memory={kv_budget.gib(budget)} per pool", pools
    budget = default_kv_cache_memory(device, pools, available)
    if device.platform != "cpu" or not available:
        return budget, "default", pools
    return budget, (f"default: {kv_budget.CPU_KV_FRACTION:.0%} of {kv_budget.gib(available)} "
                    f"available over {pools} pools, at most "
                    f"{kv_budget.gib(kv_budget.CPU_KV_CACHE_BYTES)} each"), pools


def _log_plan(asked: EngineConfig, config: EngineConfig, cfg, budget: int | None,
              source: str, pools: int) -> None:
    """One line, as vLLM logs its KV cache: pools x pages x bytes per page, where the
    budget came from, the context, and the requests the pools hold at full context."""
    page = kv_page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.page_size,
                         config.dtype)
    plan = kv_budget.KVPlan(
        pools=pools, pages=config.pages_per_shard, page_bytes=page, page_size=config.page_size,
        max_model_len=config.max_model_len, decode_shards=config.mesh.decode_dp,
        slots_per_shard=config.slots_per_shard, budget=budget or 0, source=source,
        models_context=config.max_model_len == cfg.max_position_embeddings
        and asked.max_model_len is None)
    _log.info("jaxpd: %s", plan.describe())


def _log_weights(asked: str, loaded) -> None:
    """One line: the quantization asked for, what it came to, the bytes a decode step
    reads."""
    from jaxpd.models import quant

    _log.info("jaxpd: quantization=%s -> %s (%s); weights read per decode step: %.1f MB",
              asked, loaded.quantization, quant.describe(loaded.params),
              quant.step_bytes(loaded.params, loaded.cfg.tie_word_embeddings) / 1e6)

class LLM(Frontend):
    """Load a model, build the meshes, start the engine.

    model: a Hugging Face checkpoint directory, a .gguf file, a registered name
    (`jaxpd.model_registry.MODELS`, fetched once), a hub id, or None for the built-in default.
    mesh: "prefill=P,decode=D[xT]", "colocated=N", "elastic=N" or "auto" (the default:
    `sharding.spec.auto_mesh`, one device per role on CPU). On CPU, when jax has not
    started its backends yet and no device count was set, the LLM asks for as many
    virtual devices as the mesh needs (`sharding.cpu_devices`); when jax already runs
    with fewer, "auto" fits the mesh to the devices there are (and logs why), while an
    explicit mesh that does not fit is a ValueError. warmup: compile (or load) every
    program a request can reach before returning (reporting through `progress`), so no
    request waits on a compile and none stalls a running stream; False compiles each
    on first use, for scripts that run a handful of prompts once. dtype: "auto" (float32 on
    CPU, bfloat16 on TPU/GPU), "float32" or "bfloat16". connector: how KV moves (default:
    in-process `DevicePutConnector`; a cross-process sender or receiver for single-role
    meshes "prefill=P" / "decode=D"). compilation_cache_dir: keep compiled programs
    there and load them next time (`jaxpd.xla_cache`; None: the cache jax already uses,
    e.g. the launcher's or $JAX_COMPILATION_CACHE_DIR, else `~/.cache/jaxpd/compiled`;
    "none" leaves jax as configured). plan: a prefill or decode role's mesh spans processes
    (`engine.multihost.plan_channel.PlanChannel`; `python -m jaxpd.launch --num_processes` sets it
    up). kv_cache_memory: bytes of KV each pool may hold (each decode dp shard's and the
    prefill mesh's), an int or a size such as "4GiB", "512MiB" or "2GB"
    (`kv_budget.parse_kv_cache_memory`); default `config.default_kv_cache_memory`: on CPU
    `kv_budget.CPU_KV_FRACTION` of the host's available memory split over the pools,
    each at most 2 GiB. It sets `pages_per_shard` (give one or the other) and caps the
    default `max_model_len`, the model's own context (`config.resolve_context`); a budget
    whose pools exceed the host's available memory is a ValueError. The plan is logged at
    start: pools x pages x bytes per page, the context, the concurrency at full context.
    Other keyword arguments go to `EngineConfig` (page_size, max_model_len,
    slots_per_shard, ...).
    """

    def __init__(self, model: str | None = None, mesh: str = "auto",
                 dtype: str = "auto", warmup: bool = True,
                 progress: Callable[[str], None] | None = None,
                 connector: Connector | KVSender | KVReceiver | None = None,
                 compilation_cache_dir: str | None = None, plan=None,
                 kv_cache_memory: int | str | None = None, **engine_options):
        if compilation_cache_dir is None:
            xla_cache.enable_default()
        else:
            xla_cache.enable(compilation_cache_dir)
        if plan is None:                     # a mesh across processes: the launcher's
            ensure_cpu_devices(mesh)
        if mesh == AUTO:
            mesh = _auto_mesh()
        if jax.default_backend() == "cpu":
            say_if_oversubscribed(jax.local_device_count())
        # A mesh across processes: each process reads only the weight shards its
        # devices hold, straight onto the mesh.
        shardings = None if plan is None else lambda cfg: role_shardings(cfg, mesh)
        quantization = engine_options.get("quantization", EngineConfig.quantization)
        path = resolve_model(model)
        prebuild_native(engine_options.get("attention_impl", EngineConfig.attention_impl),
                        jax.default_backend(), resolve_dtype(dtype, jax.default_backend()),
                        checkpoint.may_keep_quantized(path, quantization))
        loaded = checkpoint.load(path, dtype="float32", shardings=shardings,
                                 quantization=quantization)
        _log_weights(quantization, loaded)
        self.weights_read = loaded.weights_read
        dtype = resolve_dtype(dtype, jax.default_backend())
        asked = EngineConfig(mesh=mesh, dtype=dtype, **engine_options)
        budget, source, pools = _kv_budget(asked, kv_cache_memory, plan is not None)
        self.config = resolve_context(asked, loaded.cfg, budget or 0)
        _log_plan(asked, self.config, loaded.cfg, budget, source, pools)
        self.model_config = loaded.cfg
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(loaded, self.config, connector, warmup=warmup, progress=progress,
                             plan=plan)
        self.fingerprint = self.engine.fingerprint

    def new_request_id(self) -> str:
        return self.engine.new_request_id()

    def failure(self) -> BaseException | None:
        return self.engine.error

    def submit(self, request: Request) -> Request:
        return self.engine.submit(request)

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        return self.engine.abort(request_id, reason)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def resplit(self, prefill: int) -> elastic.Resplit:
        """An elastic mesh (`mesh="elastic=N"`): move devices so that the prefill mesh
        has `prefill` of them, while serving; every request is kept, and decoding ones
        keep their KV (`jaxpd.engine.elastic`)."""
        return elastic.resplit(self.engine, prefill, lambda msg: None)

    def prepare_resplit(self, prefill: int) -> float:
        """Build and compile the split `resplit(prefill)` moves to, now, while serving (it
        then only pauses for the move); returns the seconds it took."""
        return elastic.prepare(self.engine, prefill, lambda msg: None)

    def shutdown(self, wait_for_compiles: bool = True) -> None:
        """Stop the engine, aborting what is in flight (reason "shutdown"). A process
        that ends with `os._exit` right after may pass `wait_for_compiles=False` so a
        background compile in progress does not hold it (`Engine.shutdown`)."""
        self.engine.shutdown(wait_for_compiles=wait_for_compiles)


def _auto_mesh() -> str:
    """`auto_mesh` on the devices jax has, saying so when there are fewer than it
    wants (jax started before this process could ask for more)."""
    platform, num = jax.devices()[0].platform, jax.device_count()
    mesh = auto_mesh(platform, num)
    wanted = cpu_devices_needed(AUTO)
    if platform == "cpu" and num < wanted:
        _log.warning("mesh=auto: jax started with %d cpu device(s) before jaxpd could ask "
                     "for %d (one per role), so serving on mesh %s; set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=%d or "
                     "jax.config.update('jax_num_cpu_devices', %d) before jax starts for "
                     "one device per role", num, wanted, mesh, wanted, wanted)
    return mesh


def generate(prompts: str | Sequence[str] | None = None,
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             mesh: str = "auto", model: str | None = None,
             prompt_token_ids: Sequence[Sequence[int]] | None = None,
             **options) -> list[CompletionOutput]:
    """One shot: build an `LLM`, generate, shut it down. It compiles only the programs
    its prompts need, as they need them (`warmup=False` unless `options` say otherwise):
    there is no later request to spare the wait."""
    options.setdefault("warmup", False)
    with LLM(model=model, mesh=mesh, **options) as llm:
        return llm.generate(prompts, sampling_params, prompt_token_ids=prompt_token_ids)
