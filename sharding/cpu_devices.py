"""How many virtual CPU devices a mesh needs, and asking jax for them before its backends
start. XLA:CPU makes one device unless told otherwise, and the count is fixed once jax
initialises its backends (its first computation or `jax.devices()`), so the ask has to
come first. Importing this loads no jax: the launcher uses it before jax is imported.
"""
from __future__ import annotations

import os

from jaxpd.sharding.spec import AUTO, auto_mesh, parse_mesh_spec

COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_devices_needed(mesh: str, processes: int = 1) -> int:
    """Virtual CPU devices one process needs for `mesh` ("auto": `auto_mesh`'s CPU
    choice) when `processes` share it equally. ValueError for a malformed spec."""
    spec = auto_mesh("cpu", 2) if mesh == AUTO else mesh
    return parse_mesh_spec(spec).num_devices // processes


def platforms_allow_cpu(platforms: str | None) -> bool:
    """Whether jax may run on CPU under `platforms` (JAX_PLATFORMS' form: unset, or a
    comma-separated list naming cpu)."""
    return not platforms or "cpu" in platforms.split(",")


def ensure_cpu_devices(mesh: str, environ=os.environ) -> int | None:
    """Ask jax's CPU backend for the devices `mesh` needs (`jax_num_cpu_devices`), if its
    backends have not started yet. Returns the count asked for, or None when it leaves
    jax as it is: the platforms exclude cpu; the user chose a count (`COUNT_FLAG` in
    $XLA_FLAGS, or jax_num_cpu_devices / $JAX_NUM_CPU_DEVICES); or the backends are up
    already, their devices fixed (the caller then fits the mesh to them or says why it
    cannot).

    Nothing here starts a backend: finding out which platform jax will pick would start
    a GPU or TPU one. On such a machine the count applies to its CPU backend only,
    which a mesh on the accelerator never uses."""
    import jax

    if not platforms_allow_cpu(jax.config.jax_platforms or environ.get("JAX_PLATFORMS")):
        return None
    if COUNT_FLAG in environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices >= 0:
        return None
    num = cpu_devices_needed(mesh)
    try:
        jax.config.update("jax_num_cpu_devices", num)
    except RuntimeError:           # jax's answer once its backends are initialised
        return None
    return num
