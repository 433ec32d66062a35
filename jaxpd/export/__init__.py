"""Lower every program the engine serves for a TPU, a GPU or a CPU, on this host.

`export_programs` builds the engine a deployment would build (same model, mesh shape,
dtype, attention core, buckets), on CPU devices standing in for the target's (a mesh
of the same shape, so each program carries the shardings it is served with), and
lowers each program of `warmup.serving_programs` with `jax.export` for the target
platform: prefill buckets and long-prompt chunks, the prefill cache's programs (with
and without a prefix) and page takes, decode steps per (rows, context width), page
inserts, the penalty context update, the decode mesh's prefills with context. That is
what a first device run would otherwise be the first to check: Pallas lowering
rules and block shapes (a Mosaic `tpu_custom_call` on TPU, Triton on GPU), sharding
propagation, dtype rules. Each is written as `<name>.jax_export`
(`Exported.serialize()`) with `summary.json` beside them; `jaxpd.export.execute`
runs them on a device.

Nothing here compiles or runs a program; the engine is built with `lower_for`, so
it starts no thread and warms nothing up.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Callable

PLATFORMS = ("tpu", "cuda", "cpu")
DTYPES = ("float32", "bfloat16")

# Custom calls jax does not promise to keep stable across versions, ours to take:
# the Triton kernel of `pallas_gpu` carries its own IR and is compiled by the GPU
# backend that loads it; the native CPU kernels are registered by this package in
# the process that runs them.
_KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "jaxpd_paged_decode_f32",
                        "jaxpd_causal_prefill_f32", "jaxpd_prefix_prefill_f32")


_registered = False


def register_pytrees() -> None:
    """Let `Exported.serialize` and `deserialize` name the engine's own pytree types in
    a program's inputs and outputs (idempotent; every process that loads a file calls
    it)."""
    global _registered
    if _registered:
        return
    from jax import export
    from jaxpd.engine.programs.sampler import Logprobs, SamplingArrays

    export.register_pytree_node_serialization(
        SamplingArrays, serialized_name="jaxpd.SamplingArrays",
        serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())
    export.register_namedtuple_serialization(Logprobs, serialized_name="jaxpd.Logprobs")
    _registered = True


def default_dtype(platform: str) -> str:
    """What `LLM(dtype="auto")` serves on `platform`."""
    return "float32" if platform == "cpu" else "bfloat16"


def check_options(platform: str, mesh: str, dtype: str | None) -> tuple[str, object]:
    """(dtype, parsed mesh) after checking the options that need no model or jax;
    ValueError naming the flag otherwise."""
    from jaxpd.sharding.spec import parse_mesh_spec

    if platform not in PLATFORMS:
        raise ValueError(f"--platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    dtype = dtype or default_dtype(platform)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        spec = parse_mesh_spec(mesh)
    except ValueError as e:
        raise ValueError(f"--mesh {mesh!r}: {e}") from e
    return dtype, spec


def export_programs(platform: str, mesh: str = "prefill=4,decode=4", model: str | None = None,
                    dtype: str | None = None, attention_impl: str = "auto",
                    max_model_len: int | None = None, out: str | None = None,
                    progress: Callable[[str], None] = lambda msg: None,
                    match: str | None = None, **engine_options) -> dict:
    """Lower every serving program for `platform` ("tpu", "cuda" or "cpu") on `mesh`
    (the launcher's spec) of `model` (a checkpoint directory or registered name; None:
    the built-in model) in `dtype` (None: the platform's serving default), with the
    decode attention core `attention_impl` ("auto": what the engine picks there) and
    `max_model_len` (None: the model's context); `match`: only the programs whose name
    the regular expression finds (None: every one). Other keyword arguments go to
    `EngineConfig`. Writes `<name>.jax_export` per program and `summary.json` to `out`
    when given. Returns the summary: {"platform", "mesh", "dtype", "attention_impl",
    "model", "max_model_len", "seconds", "programs": [{"name", "file", "kernel",
    "in_shardings", "bytes"}]}.

    Bad options raise a ValueError naming the flag before anything is lowered; a
    program that fails to lower raises a RuntimeError naming it and its argument
    shapes. Needs as many devices as `mesh` (CPU ones stand in for the target's: asked
    for here if jax has not started yet, `sharding.cpu_devices`), else a ValueError."""
    dtype, spec = check_options(platform, mesh, dtype)
    try:
        wanted = re.compile(match) if match is not None else None
    except re.error as e:
        raise ValueError(f"--match {match!r} is not a regular expression: {e}") from e
    from jaxpd.sharding.cpu_devices import ensure_cpu_devices
    ensure_cpu_devices(str(spec))

    import jax
    from jaxpd.config import EngineConfig, resolve_attention_impl, resolve_context
    from jaxpd.engine.engine import Engine
    from jaxpd.engine.compile.warmup import serving_programs
    from jaxpd.model_registry import resolve_model
    from jaxpd.models import checkpoint

    have = len(jax.devices())
    if spec.num_devices > have:
        raise ValueError(f"--mesh {spec} needs {spec.num_devices} devices; this process has "
                         f"{have} {jax.devices()[0].platform} devices to stand in for them "
                         f"(on CPU, jax started before they could be asked for: set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={spec.num_devices})")
    loaded = checkpoint.load(resolve_model(model), dtype="float32")
    cfg = loaded.cfg
    try:
        impl = resolve_attention_impl(attention_impl, platform, False, dtype, cfg.head_dim)
    except ValueError as e:
        raise ValueError(f"--attention_impl {attention_impl!r} with --dtype {dtype} on "
                         f"--platform {platform}: {e}") from e
    if max_model_len and max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    try:
        # The target's memory is not this host's: no budget cuts the context or pool,
        # so every slot can reach the context (`resolve_context`).
        config = resolve_context(
            EngineConfig(mesh=spec, dtype=dtype, attention_impl=impl,
                         max_model_len=max_model_len or None, **engine_options),
            cfg, kv_cache_memory=1 << 62)
    except ValueError as e:
        raise ValueError(f"engine options: {e}") from e

    register_pytrees()
    started = time.perf_counter()
    engine = Engine(loaded, config, lower_for=platform)
    programs = []
    try:
        if out is not None:
            os.makedirs(out, exist_ok=True)
        specs = serving_programs(engine)
        for i, program_spec in enumerate(specs):
            for program in program_spec.build():
                if wanted is not None and not wanted.search(program.name):
                    continue
                progress(f"lowering {i + 1}/{len(specs)}: {program.name}")
                programs.append(_lower(program, platform, out))
    finally:
        engine.shutdown()
    names = [p["name"] for p in programs]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two serving programs share a name: {sorted(names)}")
    summary = {"platform": platform, "mesh": str(spec), "dtype": dtype,
               "attention_impl": impl, "model": loaded.path, "max_model_len": max_model_len,
               "seconds": round(time.perf_counter() - started, 3), "programs": programs}
    if out is not None:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _lower(program, platform: str, out: str | None) -> dict:
    import jax
    from jax import export

    args = program.abstract_args()
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in _KERNEL_CUSTOM_CALLS]
    try:
        exported = export.export(program.fn, platforms=[platform], disabled_checks=checks)(*args)
        data = exported.serialize()
    except Exception as e:
        shapes = ", ".join(_describe(a) for a in args)
        raise RuntimeError(f"lowering {program.name} (kernel {program.kernel}) for {platform} "
                           f"failed; its arguments: {shapes}: {type(e).__name__}: {e}") from e
    file = f"{program.name}.jax_export"
    if out is not None:
        with open(os.path.join(out, file), "wb") as f:
            f.write(data)
    return {"name": program.name, "file": file, "kernel": program.kernel,
            "in_shardings": [_shardings(a) for a in args], "bytes": len(data),
            "num_devices": exported.nr_devices}


def _leaves(tree) -> list:
    import jax
    return jax.tree.leaves(tree)


def _describe(arg) -> str:
    """One argument's shapes and dtypes, a pytree's summed up."""
    leaves = _leaves(arg)
    if len(leaves) == 1:
        x = leaves[0]
        return f"{x.dtype}{list(x.shape)}"
    return f"<{len(leaves)} arrays>"


def _shardings(arg):
    """One argument's PartitionSpec (a pytree: its leaves' distinct ones)."""
    specs = sorted({str(getattr(x.sharding, "spec", x.sharding)) for x in _leaves(arg)})
    return specs[0] if len(specs) == 1 else specs
