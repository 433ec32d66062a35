"""A process's CPUs before jax starts: how many virtual CPU devices a mesh needs and
asking for them (jax's config, or `XLA_FLAGS` for a process and the children it
starts -- the one place that rewrites `XLA_FLAGS`), and pinning the process to a set
of cores. XLA:CPU makes one device unless told otherwise, and the count and its thread
pool are fixed once jax initialises its backends (its first computation or
`jax.devices()`), so both have to come first. Importing this loads no jax: the
launcher uses it before jax is imported.
"""
from __future__ import annotations

import logging
import os
import re

from jaxpd.sharding.spec import AUTO, auto_mesh, parse_mesh_spec

COUNT_FLAG = "--xla_force_host_platform_device_count"
_log = logging.getLogger("jaxpd.cpu_devices")
_said: set[tuple[int, int]] = set()


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


def set_cpu_device_count(mesh: str, environ=os.environ, processes: int = 1) -> int | None:
    """On CPU (JAX_PLATFORMS unset or naming cpu), make XLA create as many virtual
    devices as this process's share of `mesh` needs (`processes` share it equally),
    replacing any count already in XLA_FLAGS. Returns the count, or None when the
    platform is not CPU. Must run before jax initialises."""
    # The launcher owns its process, so its mesh flag decides (a count already in
    # XLA_FLAGS is replaced), and its route is XLA_FLAGS, which the processes it starts
    # inherit; `LLM` asks the same count through jax's config (`ensure_cpu_devices`).
    if not platforms_allow_cpu(environ.get("JAX_PLATFORMS")):
        return None
    num = cpu_devices_needed(mesh, processes)
    environ["XLA_FLAGS"] = xla_flags_with_count(environ.get("XLA_FLAGS", ""), num)
    return num


def xla_flags_with_count(xla_flags: str, num: int, at_least: bool = False) -> str:
    """`xla_flags` (an `XLA_FLAGS` value) asking for `num` virtual CPU devices, its other
    flags kept; `at_least`: a count already there of at least `num` stays."""
    found = re.search(COUNT_FLAG + r"=(\d+)", xla_flags)
    if at_least and found and int(found.group(1)) >= num:
        return xla_flags
    rest = re.sub(COUNT_FLAG + r"=\S+", "", xla_flags).split()
    return " ".join(rest + [f"{COUNT_FLAG}={num}"])


def parse_cpus(spec: str, allowed: set[int] | None = None) -> set[int]:
    """"0", "1-3", "0,2-3" -> the CPU ids. ValueError naming --cpus for anything else,
    or for CPUs outside `allowed` (default: those this process may run on)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"--cpus must be CPU ids and ranges like '0' or '1-3,5', got {spec!r}")
        cpus.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    allowed = os.sched_getaffinity(0) if allowed is None else set(allowed)
    if not cpus <= allowed:
        raise ValueError(f"--cpus {spec!r} names CPUs {sorted(cpus - allowed)} this process may "
                         f"not use (allowed: {sorted(allowed)})")
    return cpus


def pin_cpus(spec: str | None) -> set[int] | None:
    """Run this process on `spec`'s CPUs only. Before jax starts: XLA:CPU sizes its
    thread pool from the CPUs the process may use, so a role pinned to a core set
    computes on those cores alone (one process per role is what isolates prefill from
    decode on a CPU: one process's devices share one pool)."""
    if spec is None:
        return None
    cpus = parse_cpus(spec)
    os.sched_setaffinity(0, cpus)
    return cpus


def compute_threads(devices: int, environ=os.environ) -> tuple[int, int]:
    """(threads XLA:CPU computes on, CPUs this process may use) with `devices` CPU
    devices. XLA sizes its intra-op pool, the threads every device's programs and
    jaxpd's native kernels share, as max($NPROC or the CPUs, the device count): the
    count, whichever route asked for it (jax's config or `COUNT_FLAG`), widens it."""
    cpus = len(os.sched_getaffinity(0))
    nproc = environ.get("NPROC", "")
    return max(int(nproc) if nproc.isdigit() and int(nproc) > 0 else cpus, devices), cpus


def say_if_oversubscribed(devices: int, environ=os.environ) -> int:
    """Log once per (threads, CPUs) when `devices` CPU devices make XLA compute on more
    threads than this process has CPUs; returns the thread count. On an idle host one
    thread per CPU is the faster pool (the threads beyond it spin looking for work and
    time-slice the cores), so a mesh or count larger than the CPUs costs speed."""
    threads, cpus = compute_threads(devices, environ)
    if threads > cpus and (threads, cpus) not in _said:
        _said.add((threads, cpus))
        _log.warning("XLA:CPU computes on %d threads on %d CPU(s): it sizes its pool by the "
                     "device count (%d) when that exceeds the CPUs; for one thread per CPU, "
                     "ask for no more devices than the mesh needs (the default) and a mesh "
                     "of at most %d devices", threads, cpus, devices, cpus)
    return threads
