"""The KV budget: how many bytes of KV each pool may hold (`kv_cache_memory`), and the
plan it comes to. Plain Python: no jax.

An engine keeps one KV pool per decode dp shard and, for a prefill mesh beside a decode
mesh in one process, one on the prefill mesh (`PrefillCache`); `kv_cache_memory` is
each pool's budget (`num_pools` counts them). Given as bytes or as a size string
(`parse_kv_cache_memory`: "4GiB", "512MiB", "2GB").

The default (`default_budget`) on an accelerator is a fraction of the memory a device
reports. On CPU the pools share host memory with the weights (a copy per mesh), the
compiled programs and every other process on the host, so the default is
`CPU_KV_FRACTION` of the memory the host has available when the engine starts
(`host_memory.available_bytes`: MemAvailable), split evenly over the pools, each at most
`CPU_KV_CACHE_BYTES`, and rounded down to four steps per power of two: available
memory moves a little from one start to the next, and a pool's size is part of every
program's shape, so an exact share would change the kept executables' keys on every
start. An explicit budget whose pools together exceed the available memory is refused
(`check_fits`) before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import re

from jaxpd.sharding.spec import MeshSpec, parse_mesh_spec

# A CPU pool's default budget at most, and where the host's available memory is
# unknown.
CPU_KV_CACHE_BYTES = 2 << 30
# Of the host's available memory, the default KV budget of every pool together on CPU:
# the rest holds the weights (a copy per mesh), the compiled programs, a second engine
# built beside this one (an elastic split) and the host's other processes.
CPU_KV_FRACTION = 0.10
# Of a device's memory (where it reports its size), one pool's default budget.
ACCELERATOR_KV_FRACTION = 0.5

FIELD = "kv_cache_memory"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(-?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]*)\s*")


def parse_kv_cache_memory(value: int | str) -> int:
    """Bytes of `value`: a positive number of bytes (an int, or a float that is whole),
    or a string of a number and an optional unit: B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024),
    any case ("4GiB", "512MiB", "2GB", "1.5GiB", "1000000"). Anything else, zero or
    negative: a ValueError naming the field (the launcher's flag says the same)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{FIELD}={value!r}: expected a whole number of bytes or a size "
                         f"such as '4GiB', '512MiB' or '2GB'")
    if isinstance(value, int):
        num = value
    else:
        match = _SIZE.fullmatch(value)
        unit = match and _UNITS.get(match.group(2).lower())
        if not unit:
            raise ValueError(f"{FIELD}={value!r} is not a size: expected bytes or a number "
                             f"with a unit of B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, such "
                             f"as '4GiB', '512MiB' or '2GB'")
        num = int(float(match.group(1)) * unit)
    if num < 1:
        raise ValueError(f"{FIELD}={value!r} must be a positive number of bytes")
    return num


def num_pools(mesh: str | MeshSpec, prefill_pool: bool) -> int:
    """KV pools an engine of `mesh` holds at once: one per decode dp shard, one more
    when its prefill mesh computes into a pool of its own (`prefill_pool`:
    `Topology.paged_prefill`, which `has_prefill_pool` predicts from the options). An
    elastic mesh counts its largest decode mesh twice: a re-split builds the new
    split's pools while the old still serve."""
    spec = parse_mesh_spec(mesh)
    if spec.elastic:
        return 2 * (spec.elastic - 1)
    return spec.decode_dp + int(prefill_pool and spec.has_prefill and not spec.colocated)


def has_prefill_pool(mesh: str | MeshSpec, enable_prefix_caching: bool,
                     layerwise_min_tokens: int, multi_process: bool = False) -> bool:
    """Whether the prefill mesh computes into a paged pool of its own, as
    `Topology.of` decides it (`enable_prefix_caching` resolved): a prefill mesh beside
    a decode mesh that caches prefixes, or that sends whole from pages (one process,
    not elastic, not layer-wise)."""
    spec = parse_mesh_spec(mesh)
    if not spec.has_prefill or spec.colocated:
        return False
    caching = bool(enable_prefix_caching)
    pages = not spec.elastic and not multi_process and layerwise_min_tokens == 0
    return caching or pages


def coarse_floor(n: int) -> int:
    """`n` rounded down to the next of 1..8, 10, 12, 14, 16, 20, 24, ...: four steps per
    power of two (as `sizes.coarse_ceil` rounds up), at most a quarter below `n`."""
    if n < 1:
        return n
    step = 1 << max(n.bit_length() - 3, 0)
    return n // step * step


def default_budget(platform: str, pools: int, available: int | None,
                   device_bytes: int | None = None) -> int:
    """Each pool's budget in bytes when none is given (see the module docstring):
    `available`: the host's available memory (`host_memory.available_bytes`) on CPU;
    `device_bytes`: what an accelerator reports (None: it reports nothing, and the
    CPU cap serves)."""
    if platform != "cpu":
        return int(device_bytes * ACCELERATOR_KV_FRACTION) if device_bytes \
            else CPU_KV_CACHE_BYTES
    if not available:
        return CPU_KV_CACHE_BYTES
    # A prefill role that pages nothing (layer-wise, or spanning processes) has no pool:
    # its budget bounds nothing, and counts as one pool's.
    pools = max(pools, 1)
    return min(CPU_KV_CACHE_BYTES, coarse_floor(int(available * CPU_KV_FRACTION) // pools))


def check_fits(budget: int, pools: int, available: int | None) -> None:
    """A ValueError naming the field when `pools` pools of `budget` bytes exceed the
    host's `available` memory (None: unknown, nothing refused)."""
    if available is not None and budget * pools > available:
        raise ValueError(
            f"{FIELD}={gib(budget)} per pool x {pools} pools needs {gib(budget * pools)} "
            f"of host memory, but {gib(available)} is available (MemAvailable); lower "
            f"{FIELD}, or leave it unset for {CPU_KV_FRACTION:.0%} of what is available")


def gib(num_bytes: int | float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """What a KV budget came to, for the start-up log: `pools` pools of at most
    `pages` pages of `page_bytes` bytes (each of `page_size` tokens, the null page
    included) for requests of up to `max_model_len` tokens on `decode_shards` decode
    dp shards of `slots_per_shard` slots each; `budget` bytes per pool and where it
    came from (`source`); `models_context`: `max_model_len` is the model's own."""
    pools: int
    pages: int
    page_bytes: int
    page_size: int
    max_model_len: int
    decode_shards: int
    slots_per_shard: int
    budget: int
    source: str
    models_context: bool = False     # max_model_len is the model's own

    def __post_init__(self):
        # No pool: a prefill role that pages nothing (layer-wise, or across processes).
        if self.pools < 0:
            raise ValueError(f"KVPlan.pools must be >= 0, got {self.pools}")
        for name in ("pages", "page_bytes", "page_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVPlan.{name} must be positive, got {getattr(self, name)}")

    @property
    def total_bytes(self) -> int:
        return self.pools * self.pages * self.page_bytes

    @property
    def concurrency(self) -> float:
        """Requests at `max_model_len` the decode pools hold at once (each shard's
        pages less the null page, over a request's pages; at most its slots)."""
        per_request = -(-self.max_model_len // self.page_size)
        per_shard = min((self.pages - 1) / per_request, self.slots_per_shard)
        return self.decode_shards * per_shard

    def describe(self) -> str:
        context = f"{self.max_model_len} (the model's)" if self.models_context \
            else f"{self.max_model_len}"
        return (f"KV cache: {self.pools} pools x {self.pages} pages x "
                f"{self.page_bytes / 1024:.1f} KiB = {gib(self.total_bytes)} "
                f"({self.source}); max_model_len {context}; concurrency at full context: "
                f"{self.concurrency:.2f} requests")
