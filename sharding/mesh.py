"""The jax meshes built from a `MeshSpec` (see `jaxpd.sharding.spec` for the grammar).

Devices are taken in order and never shared between the prefill and decode meshes
(except in `colocated`, where sharing is the point).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpd.sharding.spec import MeshSpec, parse_mesh_spec


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The meshes of one process, built from `spec`."""
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
            f"before jax starts (`LLM` and the launcher ask for them themselves unless "
            f"jax is already running or a count was set)")
    prefill_devs = devices[:spec.prefill_tp]
    start = 0 if spec.colocated else spec.prefill_tp
    decode_devs = devices[start:start + spec.decode_dp * spec.decode_tp]
    prefill = Mesh(np.array(prefill_devs), ("tp",)) if spec.has_prefill else None
    decode = (Mesh(np.array(decode_devs).reshape(spec.decode_dp, spec.decode_tp), ("dp", "tp"))
              if spec.has_decode else None)
    return Meshes(spec, prefill, decode)
