"""Mesh specs and the meshes built from them.

Spec grammar (comma-separated `role=size` parts):
  prefill=P,decode=D      P devices with axis tp; D devices with axes (dp=D, tp=1)
  prefill=P,decode=DxT    decode mesh of D data-parallel shards, each T-way tensor parallel
  colocated=N             one set of N devices doing both phases, interleaved
  prefill=P  /  decode=D  one phase only: a process of a multi-process deployment
Devices are taken in order and never shared between the prefill and decode meshes
(except in `colocated`, where sharing is the point).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh

_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    prefill_tp: int
    decode_dp: int
    decode_tp: int = 1
    colocated: bool = False

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
        if self.colocated:
            return f"colocated={self.prefill_tp}"
        parts = [f"prefill={self.prefill_tp}"] if self.has_prefill else []
        if self.has_decode:
            parts.append(f"decode={self.decode_dp}" + (f"x{self.decode_tp}" if self.decode_tp > 1 else ""))
        return ",".join(parts)


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
        if not eq or role not in ("prefill", "decode", "colocated") or not m:
            raise ValueError(f"mesh: bad part {part!r} in {spec!r}; expected prefill=N, "
                             f"decode=N or decode=DxT, or colocated=N")
        if role in parts:
            raise ValueError(f"mesh: role {role!r} given twice in {spec!r}")
        if role != "decode" and m.group(2):
            raise ValueError(f"mesh: {part!r}: only decode takes a DxT size")
        parts[role] = (int(m.group(1)), int(m.group(2) or 1))
        if min(parts[role]) < 1:
            raise ValueError(f"mesh: {part!r}: sizes must be >= 1")
    if "colocated" in parts:
        if len(parts) > 1:
            raise ValueError(f"mesh: colocated=N stands alone, got {spec!r}")
        n = parts["colocated"][0]
        return MeshSpec(prefill_tp=n, decode_dp=n, decode_tp=1, colocated=True)
    dp, tp = parts.get("decode", (0, 1))
    return MeshSpec(prefill_tp=parts.get("prefill", (0, 1))[0], decode_dp=dp, decode_tp=tp)


@dataclasses.dataclass(frozen=True)
class Meshes:
    spec: MeshSpec
    prefill: Mesh | None   # axes ("tp",); None in a decode-only process
    decode: Mesh | None    # axes ("dp", "tp"); None in a prefill-only process


def build_meshes(spec: str | MeshSpec, devices=None) -> Meshes:
    """Split `devices` (default: all) into the prefill and decode meshes."""
    spec = parse_mesh_spec(spec)
    devices = list(jax.devices() if devices is None else devices)
    if spec.num_devices > len(devices):
        raise ValueError(
            f"mesh {spec} needs {spec.num_devices} devices but only {len(devices)} "
            f"{devices[0].platform} device(s) exist; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={spec.num_devices} "
            f"before jax is imported (the launcher does this itself)")
    prefill_devs = devices[:spec.prefill_tp]
    start = 0 if spec.colocated else spec.prefill_tp
    decode_devs = devices[start:start + spec.decode_dp * spec.decode_tp]
    prefill = Mesh(np.array(prefill_devs), ("tp",)) if spec.has_prefill else None
    decode = (Mesh(np.array(decode_devs).reshape(spec.decode_dp, spec.decode_tp), ("dp", "tp"))
              if spec.has_decode else None)
    return Meshes(spec, prefill, decode)
