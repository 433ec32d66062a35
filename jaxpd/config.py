"""`EngineConfig`: every knob of the engine, validated once, passed explicitly."""
from __future__ import annotations

import dataclasses

from jaxpd import host_memory, kv_budget
from jaxpd.models.source import QUANTIZATIONS
from jaxpd.sharding.spec import MeshSpec, parse_mesh_spec


def resolve_dtype(dtype: str, backend: str) -> str:
    """The serving dtype for `dtype` ("auto", "float32" or "bfloat16") on `backend`
    (`jax.default_backend()`): "auto" is float32 on CPU, where XLA's bfloat16 is several
    times slower than float32, and bfloat16 on TPU and GPU."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    if dtype != "auto":
        return dtype
    return "float32" if backend == "cpu" else "bfloat16"


ATTENTION_IMPLS = ("auto", "reference", "native", "pallas_gpu", "pallas_tpu")
SCAN_LAYERS = ("auto", "all", "none")
QUANT_ACTIVATIONS = ("float", "int8")
# The TPU kernel's blocks end in the head dim, which Mosaic tiles by 128 lanes.
TPU_KERNEL_HEAD_DIM = 128


def resolve_attention_impl(impl: str, platform: str, interpret: bool = False,
                           dtype: str = "float32", head_dim: int | None = None) -> str:
    """The decode attention core for `impl` on devices of `platform` ("cpu", "gpu",
    "cuda", "rocm", "tpu") serving `dtype` with heads of `head_dim` (None: unknown).

    "auto" on CPU is "native" (`models/native_attention.py`, a C++ kernel built on first
    use) when it builds and the dtype is float32, else the `jnp` reference. On TPU it is
    "pallas_tpu" (JAX's paged attention kernel, which JAX tests on TPUs) for bfloat16
    and a head dim that is a multiple of 128: every serving program with it lowers for
    TPU with its Mosaic call (`jaxpd.export`, in CI) and it matches the reference in
    TPU interpret mode; other head dims do not lower, and float32 would be computed in
    bfloat16 by the kernel, so those get the reference. On GPU "auto" is the
    reference: our Triton kernel lowers but no device run has timed it. A Pallas
    kernel for another platform runs only in Pallas interpret mode (`interpret`, for
    tests)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    kind = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if impl == "auto":
        impl = "reference"
        if kind == "cpu" and dtype == "float32" and not interpret and _native_available():
            impl = "native"
        if kind == "tpu" and dtype == "bfloat16" and head_dim is not None and \
                head_dim % TPU_KERNEL_HEAD_DIM == 0:
            impl = "pallas_tpu"
    if impl in ("reference", "native"):
        if interpret:
            raise ValueError("attention_interpret=True needs a Pallas attention_impl ('pallas_gpu' "
                             f"or 'pallas_tpu'); it resolved to {impl!r} on {platform}")
        if impl == "native":
            _check_native(kind, dtype)
        return impl
    if impl != f"pallas_{kind}" and not interpret:
        raise ValueError(f"attention_impl={impl!r} cannot run on {platform} devices; use "
                         f"'auto' or 'reference', or attention_interpret=True (Pallas "
                         f"interpret mode, slow: tests only)")
    if impl == "pallas_tpu" and not interpret and head_dim is not None and \
            head_dim % TPU_KERNEL_HEAD_DIM:
        raise ValueError(f"attention_impl='pallas_tpu' needs a head dim that is a multiple of "
                         f"{TPU_KERNEL_HEAD_DIM} (Mosaic's lane tiling), the model's is "
                         f"{head_dim}; use 'auto' or 'reference'")
    return impl


def prebuild_native(impl: str, platform: str, dtype: str, quantized: bool) -> None:
    """Start building the native kernels on threads of their own where they will be
    asked for (`native_attention.prebuild`), so a cold start builds them while it loads
    weights: the attention kernels where `resolve_attention_impl(impl, platform)` with
    `dtype` asks (CPU, float32), the quantized products where the weights will be
    `quantized` (CPU, float32: `Engine._quant_matmul`)."""
    if platform != "cpu" or dtype != "float32":
        return
    from jaxpd.models import native_attention
    native_attention.prebuild(attention=impl in ("auto", "native"), quantized=quantized)


def _native_available() -> bool:
    from jaxpd.models import native_attention
    return native_attention.available()


def _check_native(kind: str, dtype: str) -> None:
    if kind != "cpu":
        raise ValueError(f"attention_impl='native' runs on CPU devices only, not {kind}")
    if dtype != "float32":
        raise ValueError(f"attention_impl='native' serves float32 only, not dtype={dtype!r}")
    from jaxpd.models import native_attention
    if not native_attention.available():
        raise ValueError("attention_impl='native' could not be built here: "
                         f"{native_attention.unavailable_reason()}")


def prefix_caching_by_default(mesh: str | MeshSpec, layerwise_min_tokens: int = 0,
                              kv_transfer_dtype: str | None = None, processes: int = 1) -> bool:
    """Whether `enable_prefix_caching=None` turns the cache on -- the one place that
    decides it (`EngineConfig` for one process, the launcher for a role across
    `processes`): for disaggregated meshes -- one process holding a prefill mesh beside
    a decode mesh, and the prefill and decode role processes of a router deployment --
    where fresh prompts are as fast with it as without and repeated prefixes reach their
    first token sooner. Off elsewhere until measured: colocated meshes (whose every
    prefill runs with context), and what the cache does not support (elastic, layer-wise
    or compressed transfer; a role's mesh spanning processes)."""
    if processes != 1:
        return False
    mesh = parse_mesh_spec(mesh)
    return (not mesh.colocated and not mesh.elastic and layerwise_min_tokens == 0
            and kv_transfer_dtype is None and processes == 1)


def kv_page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                  dtype: str) -> int:
    """Bytes of one page of K and V over every layer."""
    width = 2 if dtype == "bfloat16" else 4
    return 2 * num_layers * page_size * num_kv_heads * head_dim * width


def fit_context(max_position_embeddings: int, page_bytes: int, page_size: int,
                kv_cache_memory: int, slots_per_shard: int, max_model_len: int | None = None,
                ) -> tuple[int, int]:
    """(max_model_len, pages_per_shard) for a KV budget of `kv_cache_memory` bytes per
    pool (each decode dp shard's, and the prefill mesh's): `max_model_len` None means
    the model's own context; every slot can reach it when the budget holds that
    (`slots_per_shard` x its pages), else the pool is what the budget holds and slots
    share it (a shard that runs out preempts its youngest). A context the budget
    cannot hold once is cut to what it holds, or refused when it was asked for
    (ValueError naming both fields)."""
    pages = kv_cache_memory // page_bytes - 1          # less the null page
    limit = min(max_position_embeddings, pages * page_size)
    if limit < 2:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds {max(pages, 0)} pages "
                         f"of {page_bytes} bytes: not one request")
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > pages * page_size:
        raise ValueError(f"max_model_len={max_model_len} does not fit kv_cache_memory="
                         f"{kv_cache_memory} bytes ({pages} pages of {page_size} tokens); "
                         f"raise kv_cache_memory or lower max_model_len")
    per_slot = -(-max_model_len // page_size)
    return max_model_len, min(slots_per_shard * per_slot, pages) + 1


_SAME = object()


def knob(default, help: str, *, launch_default=_SAME, **flag):
    """An `EngineConfig` field and what its `python -m jaxpd.launch` flag says (the flag
    is generated from the field: `jaxpd.serving.config_flags`): `help`, absl's options
    in `flag` (`lower_bound`, `choices`), and `launch_default` where the flag's default
    is not the field's because `LLM` resolves an unset value itself ("auto" mesh and
    dtype; the context, None in the field too, is resolved against the model)."""
    metadata = {"help": help, "flag": flag}
    if launch_default is not _SAME:
        metadata["launch_default"] = launch_default
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine; each field's metadata holds its launch flag's help."""
    mesh: str | MeshSpec = knob(
        "prefill=4,decode=4", "Mesh spec: prefill=P,decode=D[xT], colocated=N, elastic=N, "
        "or auto: on CPU one device per role (prefill=1,decode=1, or the role's =1), which "
        "is fastest there; on accelerators the devices split in half (a role takes them "
        "all).", launch_default="auto")
    dtype: str = knob(
        "float32", "Dtype of the weights and the KV cache; auto: float32 on CPU, bfloat16 on "
        "TPU/GPU.", launch_default="auto", choices=["auto", "float32", "bfloat16"])
    page_size: int = knob(16, "Tokens per KV-cache page (a power of two).", lower_bound=1)
    max_model_len: int | None = knob(
        None, "Prompt + generated tokens per request (default: the model's "
        "max_position_embeddings, capped by what --kv_cache_memory holds: `resolve_context`).",
        lower_bound=2)
    max_prompt_len: int | None = knob(
        None, "Longest prompt in tokens (default: max_model_len - 1).", lower_bound=1)
    max_prefill_batch: int = knob(8, "Most requests in one prefill batch.", lower_bound=1)
    prefill_chunk_tokens: int = knob(
        2048, "A prefill mesh prefills a prompt longer than this (a power of two) in chunks "
        "of this many tokens, each attending to the earlier ones, so its programs stop at "
        "this length whatever max_model_len is.", lower_bound=16)
    chunked_prefill_tokens: int | None = knob(
        None, "Colocated meshes: each engine iteration runs one decode step and prefills "
        "at most this many (padded) prompt tokens, a long prompt in chunks of it, so it "
        "delays the running streams by one chunk per step (a power of two; unset: whole "
        "prompts between steps).", lower_bound=16)
    max_prefill_tokens: int | None = knob(
        None, "Most prompt tokens in one prefill batch (default: 2048, or the longest prompt "
        "a batch holds whole if longer: a chunked prompt's batch holds one chunk).",
        lower_bound=1)
    bucket_timeout_ms: float = knob(5.0, "Longest wait for a prefill batch to fill.",
                                    lower_bound=0)
    min_prefill_batch: int = knob(
        1, "A prefill batch of fewer requests than this takes the oldest of shorter "
        "buckets along, padded to its own.", lower_bound=1)
    slots_per_shard: int = knob(32, "Decode slots per decode dp shard (a step runs only as "
                                "many rows as it needs).", lower_bound=1)
    decode_context_step: int = knob(
        8, "A decode step computes its context in multiples of this many pages (one "
        "compiled program per width).", lower_bound=1)
    pages_per_shard: int | None = knob(
        None, "KV pages per decode dp shard's pool (default: what --kv_cache_memory holds, at "
        "most enough for every slot to reach max_model_len).", lower_bound=2)
    max_queued: int = knob(4096, "Requests waiting for prefill (on a router and behind "
                           "the HTTP API: requests in flight) before new ones get "
                           "RESOURCE_EXHAUSTED / 429.", lower_bound=1)
    local_prefill_below: int = knob(
        0, "Prompts shorter than this are prefilled on the decode mesh itself (no "
        "transfer); 0 = never.", lower_bound=0)
    kv_transfer_dtype: str | None = knob(
        None, "Compress KV in transit (per-page scales; lossy). Unset: send it as stored.",
        choices=["int8", "fp8"])
    layerwise_min_tokens: int = knob(
        0, "Prefill buckets of at least this many tokens send their KV layer group by layer "
        "group, each as soon as it is computed, overlapping the transfer with the rest of "
        "the prefill; 0 = always whole.", lower_bound=0)
    layerwise_parts: int = knob(4, "Layer groups of a layer-wise transfer.", lower_bound=2)
    migrate_on_drain: bool | None = knob(
        None, "Decode role: when this worker drains (SIGTERM, a role switch), each decoding "
        "request moves to another decode worker with its KV and sampling state and goes on "
        "from its next token, instead of being prefilled again there (either KV transport; "
        "a move that fails falls back to the prefill; with no other decode worker its "
        "requests finish in place). Default: on for decode role workers, their mesh in one "
        "process or across several (--nomigrate_on_drain turns it off); meaningless "
        "elsewhere. Warms the page-take programs.")
    kv_part_timeout_s: float = knob(
        30.0, "Decode side: a layer-wise part overdue by this long fails its transfer (the "
        "request is prefilled again).", lower_bound=0.001)
    handoff_wait_ms: float = knob(
        200.0, "prefill role, transfer server: before its next batch, wait up to this long "
        "for the decode side to pull the last handoffs (the pull is served by this "
        "process; a long prefill would hold it up). 0: do not wait.", lower_bound=0)
    enable_prefix_caching: bool | None = knob(
        None, "Cache full KV pages by content on the decode mesh and on the prefill mesh: a "
        "request sharing a cached prefix computes only the rest (on the decode mesh when "
        "the rest is short) and its handoff carries only the pages the decode side lacks. "
        "Default: on for disaggregated meshes (one process with prefill and decode meshes, "
        "and prefill or decode role processes), off for colocated, elastic, layer-wise, "
        "compressed and multi-process roles (--noenable_prefix_caching turns it off). On "
        "a router: route by the prefixes the workers' caches advertise unless "
        "--noenable_prefix_caching.")
    prefix_extend_below: int = knob(
        256, "With prefix caching: a request whose uncached rest is shorter than this is "
        "prefilled on the decode mesh.", lower_bound=0)
    kv_host_cache_gb: float = knob(
        0.0, "With prefix caching: GiB of host memory that keep full prefix pages the decode "
        "pool evicts (LRU by bytes, a checksum per page), restored into the pool when a "
        "request's prefix continues there instead of being computed. 0: off.", lower_bound=0)
    prefill_host_cache_gb: float = knob(
        0.0, "With prefix caching: GiB of host memory that keep full prefix pages the prefill "
        "mesh's own cache evicts (as kv_host_cache_gb does for the decode pool), restored "
        "into its pool when a prompt's prefix continues there instead of being computed. "
        "0: off.", lower_bound=0)
    prefill_cache_pages: int | None = knob(
        None, "With prefix caching: pages of the prefill mesh's own cache. Default: as many "
        "as a decode shard's pool, at least what its largest prefill batch needs.",
        lower_bound=2)
    attention_impl: str = knob(
        "auto", "Attention core: 'auto' is 'native' on CPU (C++ kernels built on first use, "
        "for decode, and for prefill where the CPU has AVX-512; the jnp reference where "
        "they cannot be built) and the jnp reference elsewhere (the Pallas kernels are "
        "opt-in until checked on a device).", choices=list(ATTENTION_IMPLS))
    attention_interpret: bool = knob(
        False, "Run a Pallas attention kernel in interpret mode (slow: tests on CPU).")
    quantization: str = knob(
        "auto", "Weights: 'none' (float), 'int8' (weight-only, one scale per output channel, "
        "made at load), 'auto' (a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K blocks kept and "
        "multiplied without unpacking to float; other files float).",
        choices=list(QUANTIZATIONS))
    quant_activations: str = knob(
        "float", "Activations of the native CPU product of quantized weights (float32 "
        "meshes without tp): 'float' (each block of weights unpacked to float32 in "
        "registers and multiplied with x as it is) or 'int8' (each row of x rounded to "
        "int8 blocks of 32 with a scale each, as llama.cpp does, and each block's product "
        "taken in integers: faster, but x loses precision, so greedy tokens can differ "
        "where two logits nearly tie). With 'int8' a CPU mesh that only prefills keeps "
        "the weights quantized too and runs its prompts through the same product.",
        choices=list(QUANT_ACTIVATIONS))
    compile_threads: int | None = knob(
        None, "Threads compiling warm-up's programs at once (XLA compiles one program on "
        "one core; default: the host's CPU count, at most 4).", lower_bound=1)
    scan_layers: str = knob(
        "auto", "Run each run of identical decoder layers as one jax.lax.scan over their "
        "stacked weights, so XLA compiles one layer body instead of every layer: 'all' "
        "on every mesh (the shortest warm-up; XLA:CPU copies each float layer's weights "
        "out of the stack per call, which slows memory-bound programs: decode steps, "
        "short prompts), 'auto' only where every product reads its weight in place in "
        "the stack (a CPU decode mesh running the native product of quantized weights), "
        "'none' every layer unrolled. A prefill mesh sending layer-wise stays unrolled.",
        choices=list(SCAN_LAYERS))

    def __post_init__(self):
        object.__setattr__(self, "mesh", parse_mesh_spec(self.mesh))
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {self.compile_threads}")
        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {self.max_prompt_len}")
        if self.pages_per_shard is not None and self.pages_per_shard < 2:
            raise ValueError(f"pages_per_shard must be >= 2, got {self.pages_per_shard}")
        for name in ("max_prefill_batch", "min_prefill_batch", "slots_per_shard", "max_queued",
                     "decode_context_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_bucket("prefill_chunk_tokens")
        if self.chunked_prefill_tokens is not None:
            if not self.mesh.colocated:
                raise ValueError(f"chunked_prefill_tokens is for colocated meshes, not "
                                 f"{self.mesh}; a prefill mesh chunks by prefill_chunk_tokens")
            self._check_bucket("chunked_prefill_tokens")
        if self.bucket_timeout_ms < 0:
            raise ValueError(f"bucket_timeout_ms must be >= 0, got {self.bucket_timeout_ms}")
        if self.kv_transfer_dtype not in (None, "int8", "fp8"):
            raise ValueError(f"kv_transfer_dtype must be None, 'int8' or 'fp8', "
                             f"got {self.kv_transfer_dtype!r}")
        if self.layerwise_min_tokens < 0:
            raise ValueError(f"layerwise_min_tokens must be >= 0, got {self.layerwise_min_tokens}")
        if self.layerwise_parts < 2:
            raise ValueError(f"layerwise_parts must be >= 2, got {self.layerwise_parts}")
        if self.handoff_wait_ms < 0:
            raise ValueError(f"handoff_wait_ms must be >= 0, got {self.handoff_wait_ms}")
        if self.kv_part_timeout_s <= 0:
            raise ValueError(f"kv_part_timeout_s must be positive, got {self.kv_part_timeout_s}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ValueError(f"quant_activations must be one of {QUANT_ACTIVATIONS}, "
                             f"got {self.quant_activations!r}")
        if self.scan_layers not in SCAN_LAYERS:
            raise ValueError(f"scan_layers must be one of {SCAN_LAYERS}, got {self.scan_layers!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.prefix_extend_below < 0:
            raise ValueError(f"prefix_extend_below must be >= 0, got {self.prefix_extend_below}")
        if not (self.kv_host_cache_gb >= 0 and self.kv_host_cache_gb < float("inf")):
            raise ValueError(f"kv_host_cache_gb must be a finite number >= 0, "
                             f"got {self.kv_host_cache_gb}")
        if not (self.prefill_host_cache_gb >= 0 and self.prefill_host_cache_gb < float("inf")):
            raise ValueError(f"prefill_host_cache_gb must be a finite number >= 0, "
                             f"got {self.prefill_host_cache_gb}")
        if self.prefill_cache_pages is not None and self.prefill_cache_pages < 2:
            raise ValueError(f"prefill_cache_pages must be >= 2, got {self.prefill_cache_pages}")
        if self.local_prefill_below < 0:
            raise ValueError(f"local_prefill_below must be >= 0, got {self.local_prefill_below}")
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", prefix_caching_by_default(
                self.mesh, self.layerwise_min_tokens, self.kv_transfer_dtype))
        if self.kv_host_cache_gb > 0 and not (self.enable_prefix_caching and
                                              self.mesh.has_decode):
            raise ValueError(f"kv_host_cache_gb keeps a decode pool's prefix cache in host "
                             f"memory: it needs enable_prefix_caching and a decode mesh "
                             f"(mesh {self.mesh}, enable_prefix_caching="
                             f"{self.enable_prefix_caching})")
        if self.prefill_host_cache_gb > 0 and not (
                self.enable_prefix_caching and self.mesh.has_prefill and not self.mesh.colocated):
            raise ValueError(f"prefill_host_cache_gb keeps the prefill mesh's own prefix cache "
                             f"in host memory: it needs enable_prefix_caching and a prefill "
                             f"mesh of its own (mesh {self.mesh}, enable_prefix_caching="
                             f"{self.enable_prefix_caching})")
        if self.mesh.elastic:
            # What a re-split does not move yet (`engine.elastic`): a prefix cache's pages,
            # compressed pages, and the decode mesh's own prefill.
            for name, off in (("enable_prefix_caching", False), ("kv_transfer_dtype", None),
                              ("local_prefill_below", 0)):
                if getattr(self, name) != off:
                    raise ValueError(f"{name} is not supported with mesh {self.mesh} yet "
                                     f"(an elastic split); leave it at {off!r}")
        if self.max_model_len is not None:
            self._derive_from_context()

    def _derive_from_context(self) -> None:
        """What follows from `max_model_len`, once it is known; `_derived` names the
        fields filled in here, so a config resolved again derives them afresh."""
        derived = []
        if self.max_prompt_len is None:
            derived.append("max_prompt_len")
            object.__setattr__(self, "max_prompt_len", self.max_model_len - 1)
        if not 1 <= self.max_prompt_len < self.max_model_len:
            raise ValueError(f"max_prompt_len must be in [1, max_model_len), "
                             f"got {self.max_prompt_len}")
        min_pages = self.pages_per_slot + 1
        if self.pages_per_shard is not None and self.pages_per_shard < min_pages:
            raise ValueError(f"pages_per_shard={self.pages_per_shard} cannot hold one request "
                             f"of max_model_len={self.max_model_len} (needs {min_pages} with "
                             f"the null page)")
        if self.max_prefill_tokens is None:
            # Where prompts are chunked (`Engine._build_prefill`) a batch's longest prompt
            # is a chunk; the engine raises the budget to its largest whole bucket
            # elsewhere. A budget past that only adds programs of many long rows.
            whole = min(self.buckets[-1], self.prefill_chunk_tokens)
            derived.append("max_prefill_tokens")
            object.__setattr__(self, "max_prefill_tokens", max(8 * 256, whole))
        elif self.max_prefill_tokens < self.buckets[-1]:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} is below the largest "
                             f"bucket {self.buckets[-1]}")
        object.__setattr__(self, "_derived", tuple(derived))

    def _check_bucket(self, name: str) -> None:
        """A chunk size is a bucket: a power of two of at least `min_bucket`."""
        value = getattr(self, name)
        if value < self.min_bucket or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {self.min_bucket}, got {value}")

    @property
    def resolved(self) -> bool:
        """Whether the context and the pool are known (`resolve_context` makes them so)."""
        return self.max_model_len is not None and self.pages_per_shard is not None

    def _context(self) -> int:
        if self.max_model_len is None:
            raise ValueError("max_model_len is unset until resolved against the model "
                             "(config.resolve_context)")
        return self.max_model_len

    @property
    def pages_per_slot(self) -> int:
        return -(-self._context() // self.page_size)

    @property
    def min_bucket(self) -> int:
        return max(16, self.page_size)

    @property
    def buckets(self) -> list[int]:
        # Up to max_model_len, not max_prompt_len: a preempted request is recomputed from
        # prompt + generated tokens.
        from jaxpd.engine.scheduling.buckets import length_buckets
        return length_buckets(self._context(), self.min_bucket)


def kv_pools(config: EngineConfig, multi_process: bool = False) -> int:
    """KV pools an engine of `config` holds (`kv_budget.num_pools`): one per decode dp
    shard, and the prefill mesh's own where it computes into one."""
    return kv_budget.num_pools(config.mesh, kv_budget.has_prefill_pool(
        config.mesh, config.enable_prefix_caching, config.layerwise_min_tokens, multi_process))


def default_kv_cache_memory(device, pools: int = 1, available: int | None = None) -> int:
    """A KV pool's budget in bytes when none is given (`kv_budget.default_budget`): on
    CPU `kv_budget.CPU_KV_FRACTION` of the host's available memory (`available`, read
    from /proc/meminfo when None) split over the engine's `pools` (`kv_pools`), each at
    most `kv_budget.CPU_KV_CACHE_BYTES`; on an accelerator
    `kv_budget.ACCELERATOR_KV_FRACTION` of the memory `device` (a jax device) reports
    (the CPU cap on one that reports none)."""
    if device.platform == "cpu":
        if available is None:
            available = host_memory.available_bytes()
        return kv_budget.default_budget("cpu", pools, available)
    stats = device.memory_stats()
    return kv_budget.default_budget(device.platform, pools, None,
                                    stats.get("bytes_limit") if stats else None)


def resolve_context(config: EngineConfig, model_cfg, kv_cache_memory: int) -> EngineConfig:
    """`config` with its context and pool resolved against the model (`model_cfg`, a
    `ModelConfig`) and a KV budget of `kv_cache_memory` bytes per pool: the one rule
    for `LLM` and an `Engine` built from a config directly. `max_model_len` None is the
    model's own context (`max_position_embeddings`), cut to what the budget holds
    unless `pages_per_shard` is given; `pages_per_shard` None is what the budget holds,
    at most enough for every slot to reach `max_model_len` (`fit_context`). A context
    past the model's, or one the budget cannot hold, is a ValueError naming both."""
    limit = model_cfg.max_position_embeddings
    asked = config.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's "
                         f"max_position_embeddings={limit}")
    if config.pages_per_shard is not None and asked is not None:
        return config
    # What the config derived from an asked context is derived again from the resolved one.
    fresh = {name: None for name in getattr(config, "_derived", ())}
    if config.pages_per_shard is not None:
        return dataclasses.replace(config, max_model_len=limit, **fresh)
    if kv_cache_memory < 1:
        raise ValueError(f"kv_cache_memory must be a positive number of bytes, "
                         f"got {kv_cache_memory}")
    page = kv_page_bytes(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                         config.page_size, config.dtype)
    length, pages = fit_context(limit, page, config.page_size, kv_cache_memory,
                                config.slots_per_shard, asked)
    return dataclasses.replace(config, max_model_len=length, pages_per_shard=pages, **fresh)
