"""Mesh specs: which devices each role gets, as plain data.

Spec grammar (comma-separated `role=size` parts):
  prefill=P,decode=D      P devices with axis tp; D devices with axes (dp=D, tp=1)
  prefill=P,decode=DxT    decode mesh of D data-parallel shards, each T-way tensor parallel
  colocated=N             one set of N devices doing both phases, interleaved
  prefill=P  /  decode=D  one phase only: a process of a multi-process deployment
  elastic=N[,prefill=P]   N devices split prefill=P,decode=N-P (default P = N // 2),
                          a split `LLM.resplit` moves while serving

Plain Python, no jax import: the launcher must count the devices a spec needs before
jax starts (it sets XLA_FLAGS from it), and the router, planner and config validation
parse specs without any accelerator. `jaxpd.sharding.mesh` builds the meshes.
"""
from __future__ import annotations

import dataclasses
import re

_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Device counts of the prefill mesh (tp) and the decode mesh (dp x tp); a count of
    0 means this process has no such mesh. `str(spec)` parses back to the same spec."""
    prefill_tp: int
    decode_dp: int
    decode_tp: int = 1
    colocated: bool = False
    elastic: int = 0        # N > 0: an elastic split of N devices (prefill + decode = N)

    def __post_init__(self):
        # 0 means "this process has no such mesh" (single-role processes).
        for name in ("prefill_tp", "decode_dp"):
            if getattr(self, name) < 0:
                raise ValueError(f"mesh: {name} must be >= 0, got {getattr(self, name)}")
        if self.decode_tp < 1:
            raise ValueError(f"mesh: decode_tp must be >= 1, got {self.decode_tp}")
        if not self.prefill_tp and not self.decode_dp:
            raise ValueError("mesh: needs a prefill or a decode mesh (or both)")
        if self.colocated and self.prefill_tp != self.decode_dp * self.decode_tp:
            raise ValueError("mesh: colocated prefill and decode must span the same devices")
        if self.elastic and not (self.prefill_tp >= 1 and self.decode_dp >= 1
                                 and self.prefill_tp + self.decode_dp == self.elastic
                                 and self.decode_tp == 1 and not self.colocated):
            raise ValueError(f"mesh: elastic={self.elastic} splits its devices into prefill=P "
                             f"and decode=N-P, each at least 1 (got prefill={self.prefill_tp}, "
                             f"decode={self.decode_dp}x{self.decode_tp})")

    def split(self, prefill: int) -> "MeshSpec":
        """This elastic spec with `prefill` devices on the prefill mesh."""
        if not self.elastic:
            raise ValueError(f"mesh {self} is not elastic (--mesh elastic=N)")
        if not 1 <= prefill < self.elastic:
            raise ValueError(f"prefill must be in [1, {self.elastic - 1}] for mesh "
                             f"elastic={self.elastic}, got {prefill}")
        return MeshSpec(prefill, self.elastic - prefill, elastic=self.elastic)

    @property
    def num_devices(self) -> int:
        if self.colocated:
            return self.prefill_tp
        return self.prefill_tp + self.decode_dp * self.decode_tp

    @property
    def has_prefill(self) -> bool:
        return self.prefill_tp > 0

    @property
    def has_decode(self) -> bool:
        return self.decode_dp > 0

    def __str__(self) -> str:
        if self.elastic:
            return f"elastic={self.elastic},prefill={self.prefill_tp}"
        if self.colocated:
            return f"colocated={self.prefill_tp}"
        parts = [f"prefill={self.prefill_tp}"] if self.has_prefill else []
        if self.has_decode:
            parts.append(f"decode={self.decode_dp}" + (f"x{self.decode_tp}" if self.decode_tp > 1 else ""))
        return ",".join(parts)


AUTO = "auto"


def auto_mesh(platform: str, num_devices: int, role: str | None = None) -> str:
    """The mesh `mesh="auto"` serves on `num_devices` devices of `platform`, for the whole
    engine (`role` None) or one role's process ("prefill" / "decode").

    On CPU, one device per role: a process's XLA:CPU devices share one thread pool over
    every core, so one device already computes with all of them; more virtual devices
    add collectives (tp) or read the weights once per shard (dp) for no extra compute;
    with only one device (jax started before anyone asked
    for two, `jaxpd.sharding.cpu_devices`), colocated on it. On accelerators, the devices
    split in half: tp prefill, dp decode (one device: colocated)."""
    if role not in (None, "prefill", "decode"):
        raise ValueError(f"role must be None, 'prefill' or 'decode', got {role!r}")
    if num_devices < 1:
        raise ValueError(f"mesh=auto needs at least one device, got {num_devices}")
    if platform == "cpu":
        return f"{role}=1" if role else "prefill=1,decode=1" if num_devices > 1 else "colocated=1"
    if role:
        return f"{role}={num_devices}"
    if num_devices == 1:
        return "colocated=1"
    return f"prefill={num_devices // 2},decode={num_devices - num_devices // 2}"


def parse_mesh_spec(spec: str | MeshSpec) -> MeshSpec:
    """`"prefill=4,decode=4"` -> MeshSpec; a malformed spec is a ValueError naming the bad part."""
    if isinstance(spec, MeshSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh: expected a spec like 'prefill=4,decode=4' or 'colocated=8', "
                         f"got {spec!r}")
    parts: dict[str, tuple[int, int]] = {}
    for part in spec.replace(" ", "").split(","):
        role, eq, size = part.partition("=")
        m = _SIZE.match(size)
        if not eq or role not in ("prefill", "decode", "colocated", "elastic") or not m:
            raise ValueError(f"mesh: bad part {part!r} in {spec!r}; expected prefill=N, "
                             f"decode=N or decode=DxT, colocated=N, or elastic=N")
        if role in parts:
            raise ValueError(f"mesh: role {role!r} given twice in {spec!r}")
        if role != "decode" and m.group(2):
            raise ValueError(f"mesh: {part!r}: only decode takes a DxT size")
        parts[role] = (int(m.group(1)), int(m.group(2) or 1))
        if min(parts[role]) < 1:
            raise ValueError(f"mesh: {part!r}: sizes must be >= 1")
    if "elastic" in parts:
        n = parts["elastic"][0]
        if "decode" in parts or "colocated" in parts or n < 2:
            raise ValueError(f"mesh: elastic=N (N >= 2) takes only an optional prefill=P, "
                             f"got {spec!r}")
        return MeshSpec(n // 2, n - n // 2, elastic=n).split(parts.get("prefill", (n // 2,))[0])
    if "colocated" in parts:
        if len(parts) > 1:
            raise ValueError(f"mesh: colocated=N stands alone, got {spec!r}")
        n = parts["colocated"][0]
        return MeshSpec(prefill_tp=n, decode_dp=n, decode_tp=1, colocated=True)
    dp, tp = parts.get("decode", (0, 1))
    return MeshSpec(prefill_tp=parts.get("prefill", (0, 1))[0], decode_dp=dp, decode_tp=tp)
