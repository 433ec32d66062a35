"""`EngineConfig`: every knob of the engine, validated once, passed explicitly."""
from __future__ import annotations

import dataclasses

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
_AUTO: dict[str, str] = {}       # platform -> its checked Pallas kernel (none yet: see below)


def resolve_attention_impl(impl: str, platform: str, interpret: bool = False,
                           dtype: str = "float32") -> str:
    """The decode attention core for `impl` on devices of `platform` ("cpu", "gpu",
    "cuda", "rocm", "tpu") serving `dtype`.

    "auto" on CPU is "native" (`models/native_attention.py`, a C++ kernel built on first
    use) when it builds and the dtype is float32, else the `jnp` reference. On GPU and
    TPU "auto" is the reference for now: the Pallas kernels are checked against it only
    in interpret mode on CPU, never yet compiled on a GPU or TPU, and a default must not
    fail to start there; `_AUTO` is where a platform's kernel becomes its default once a
    device run has checked it. A Pallas kernel for another platform runs only in Pallas
    interpret mode (`interpret`, for tests)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    kind = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if impl == "auto":
        impl = _AUTO.get(kind, "reference")
        if kind == "cpu" and dtype == "float32" and not interpret and _native_available():
            impl = "native"
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
    return impl


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


def prefix_caching_by_default(config: "EngineConfig") -> bool:
    """Whether `enable_prefix_caching=None` turns the cache on: for disaggregated meshes
    -- one process holding a prefill mesh beside a decode mesh, and the prefill and
    decode role processes of a router deployment -- where fresh prompts are as fast
    with it as without and repeated prefixes reach their first token sooner. Off
    elsewhere until measured: colocated meshes (whose
    every prefill runs with context), and what the cache does not support (elastic,
    layer-wise or compressed transfer; a role spanning processes, which the launcher
    resolves off)."""
    mesh = config.mesh
    return (not mesh.colocated and not mesh.elastic and config.layerwise_min_tokens == 0
            and config.kv_transfer_dtype is None)


CPU_KV_CACHE_BYTES = 2 << 30      # a pool's default budget on CPU
ACCELERATOR_KV_FRACTION = 0.5      # of a device's memory, where it reports its size


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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    mesh: str | MeshSpec = "prefill=4,decode=4"
    dtype: str = "float32"
    page_size: int = 16
    max_model_len: int = 1024          # prompt + generated tokens, per request
    max_prompt_len: int | None = None  # default: max_model_len - 1
    max_prefill_batch: int = 8
    # A prefill mesh beside a decode mesh prefills a prompt longer than this in chunks
    # of this many tokens, each attending to the pages of the ones before it, so its
    # programs stop at this length whatever max_model_len is (a power of two).
    prefill_chunk_tokens: int = 2048
    max_prefill_tokens: int | None = None  # default: max(8 * 256, largest bucket)
    bucket_timeout_ms: float = 5.0
    min_prefill_batch: int = 1
    slots_per_shard: int = 32          # a step runs only as many rows as it needs
    decode_context_step: int = 8       # decode computes context in multiples of these pages
    pages_per_shard: int | None = None # default: every slot can reach max_model_len
    max_queued: int = 4096             # requests waiting for prefill before rejection
    local_prefill_below: int = 0       # prompts shorter than this prefill on the decode mesh
    kv_transfer_dtype: str | None = None  # "int8" / "fp8": compressed, lossy transfer
    # Layer-wise transfer: prefill buckets of at least this many tokens send their KV in
    # `layerwise_parts` layer groups, each as soon as it is computed (0: never).
    layerwise_min_tokens: int = 0
    layerwise_parts: int = 4
    kv_part_timeout_s: float = 30.0    # decode side: a layer-wise part overdue -> re-prefill
    # Prefill side, a sender whose peer pulls (the transfer server): before the next
    # batch, wait up to this long for the last handoffs to be pulled (0: do not wait).
    handoff_wait_ms: float = 200.0
    # Prefix caching (full KV pages, content-addressed, shared by reference;
    # `engine.page_allocator`): the decode mesh prefills with context what it finds
    # cached in its pool. With a prefill mesh, a request whose cached prefix leaves
    # fewer than `prefix_extend_below` tokens to compute is prefilled on the decode
    # mesh; the others on the prefill mesh, which keeps its own cache of
    # `prefill_cache_pages` pages (`engine.prefill_cache`; default: pages_per_shard,
    # at least what its largest batch needs). None: on where it is measured not to lose
    # when nothing repeats (`prefix_caching_by_default`), else off.
    enable_prefix_caching: bool | None = None
    prefix_extend_below: int = 256
    prefill_cache_pages: int | None = None
    # Decode attention core: "auto" (the backend's), "reference" (jnp), "native" (CPU,
    # C++), "pallas_gpu", "pallas_tpu"; `resolve_attention_impl` checks it against the
    # decode devices.
    attention_impl: str = "auto"
    attention_interpret: bool = False  # run the Pallas kernel interpreted (CPU tests)

    def __post_init__(self):
        object.__setattr__(self, "mesh", parse_mesh_spec(self.mesh))
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_prompt_len is None:
            object.__setattr__(self, "max_prompt_len", self.max_model_len - 1)
        if not 1 <= self.max_prompt_len < self.max_model_len:
            raise ValueError(f"max_prompt_len must be in [1, max_model_len), got {self.max_prompt_len}")
        for name in ("max_prefill_batch", "min_prefill_batch", "slots_per_shard", "max_queued",
                     "decode_context_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk_tokens < self.min_bucket or \
                self.prefill_chunk_tokens & (self.prefill_chunk_tokens - 1):
            raise ValueError(f"prefill_chunk_tokens must be a power of two >= {self.min_bucket}, "
                             f"got {self.prefill_chunk_tokens}")
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
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        if self.prefix_extend_below < 0:
            raise ValueError(f"prefix_extend_below must be >= 0, got {self.prefix_extend_below}")
        if self.prefill_cache_pages is not None and self.prefill_cache_pages < 2:
            raise ValueError(f"prefill_cache_pages must be >= 2, got {self.prefill_cache_pages}")
        if self.local_prefill_below < 0:
            raise ValueError(f"local_prefill_below must be >= 0, got {self.local_prefill_below}")
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", prefix_caching_by_default(self))
        if self.mesh.elastic:
            # What a re-split does not move yet (`engine.elastic`): a prefix cache's pages,
            # compressed pages, and the decode mesh's own prefill.
            for name, off in (("enable_prefix_caching", False), ("kv_transfer_dtype", None),
                              ("local_prefill_below", 0)):
                if getattr(self, name) != off:
                    raise ValueError(f"{name} is not supported with mesh {self.mesh} yet "
                                     f"(an elastic split); leave it at {off!r}")
        min_pages = self.pages_per_slot + 1
        if self.pages_per_shard is None:
            object.__setattr__(self, "pages_per_shard", self.slots_per_shard * self.pages_per_slot + 1)
        elif self.pages_per_shard < min_pages:
            raise ValueError(f"pages_per_shard={self.pages_per_shard} cannot hold one request of "
                             f"max_model_len={self.max_model_len} (needs {min_pages} with the null page)")
        if self.max_prefill_tokens is None:
            object.__setattr__(self, "max_prefill_tokens", max(8 * 256, self.buckets[-1]))
        elif self.max_prefill_tokens < self.buckets[-1]:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} is below the largest "
                             f"bucket {self.buckets[-1]}")

    @property
    def pages_per_slot(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def min_bucket(self) -> int:
        return max(16, self.page_size)

    @property
    def buckets(self) -> list[int]:
        # Up to max_model_len, not max_prompt_len: a preempted request is recomputed from
        # prompt + generated tokens.
        from jaxpd.engine.scheduler import length_buckets
        return length_buckets(self.max_model_len, self.min_bucket)
