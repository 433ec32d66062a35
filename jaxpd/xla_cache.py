"""The persistent XLA compilation cache: compiled programs kept on disk, so a restart
(or another process of the same deployment: the router's workers, a second replica)
loads them instead of compiling again.

jax's own thresholds skip programs that compile in under a second, which is every
program of a small model; unless the environment sets them, both are 0 here.

Warm-up keeps its programs' executables whole beside it (`kept_dir`,
`engine.compile.executable_cache`): found without tracing, on the same switch as this cache.
"""
from __future__ import annotations

import os

from jaxpd import paths

OFF = "none"
KEPT = "jaxpd-executables"


def default_dir() -> str:
    """`$JAX_COMPILATION_CACHE_DIR` if set, else `$JAXPD_CACHE/compiled` (`jaxpd.paths`)."""
    return paths.xla_dir()


def enable_default() -> str:
    """For a caller that names no directory (`LLM()`): the cache jax already uses (the
    launcher's `--compilation_cache_dir`, $JAX_COMPILATION_CACHE_DIR), else
    `default_dir()`, with this module's thresholds. Returns the directory."""
    import jax

    return enable(jax.config.jax_compilation_cache_dir or default_dir())


def enable(path: str | None) -> str | None:
    """Keep compiled programs under `path` from now on (call before the first compile);
    None or "none": leave jax as configured. Returns the directory in use, if any."""
    if path is None or path == OFF:
        return None
    if not isinstance(path, str) or not path:
        raise ValueError(f"compilation_cache_dir must be a directory or {OFF!r}, got {path!r}")
    import jax

    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    for option in ("jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes"):
        if option.upper() not in os.environ:
            jax.config.update(option, 0)
    return path


def kept_dir() -> str | None:
    """Where warm-up keeps executables (`engine.compile.executable_cache`):
    `jaxpd-executables/` inside the compilation cache jax uses now; None when it uses
    none, or when `$JAXPD_KEEP_EXECUTABLES` is 0."""
    import jax

    path = jax.config.jax_compilation_cache_dir
    if not path or os.environ.get("JAXPD_KEEP_EXECUTABLES", "1") == "0":
        return None
    return os.path.join(path, KEPT)
