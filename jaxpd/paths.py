"""Where jaxpd keeps what it writes once and reads on later starts: one root,
`$JAXPD_CACHE` (default `~/.cache/jaxpd`), and one subdirectory per kind.

    models/       checkpoints the model registry downloads (`jaxpd.model_registry`)
    xla/          the persistent XLA compilation cache (`jaxpd.xla_cache`), unless
                  `$JAX_COMPILATION_CACHE_DIR` names another
    native/       the compiled CPU attention kernels (`models.native_attention`)
    fingerprint/  weight digests by checkpoint path, size and mtime (`models.fingerprint`)

`$JAXPD_CACHE_DIR` is read as a deprecated alias of `$JAXPD_CACHE` (with a warning),
for a user who set it to move the native kernels.

Plain Python, no jax: the router and the fingerprint import it.
"""
from __future__ import annotations

import logging
import os

ENV = "JAXPD_CACHE"
DEPRECATED_ENV = "JAXPD_CACHE_DIR"
_log = logging.getLogger(__name__)
_warned = False


def cache_root() -> str:
    """`$JAXPD_CACHE`, else the deprecated `$JAXPD_CACHE_DIR`, else `~/.cache/jaxpd`."""
    global _warned
    root = os.environ.get(ENV)
    if not root and os.environ.get(DEPRECATED_ENV):
        root = os.environ[DEPRECATED_ENV]
        if not _warned:
            _warned = True
            _log.warning("%s is deprecated: set %s instead (the one cache root)",
                         DEPRECATED_ENV, ENV)
    return os.path.expanduser(root or os.path.join("~", ".cache", "jaxpd"))


def models_dir() -> str:
    return os.path.join(cache_root(), "models")


def xla_dir() -> str:
    """`$JAX_COMPILATION_CACHE_DIR` if set (jax's own variable), else `<root>/compiled`.
    jax's entries and warm-up's kept executables live there together: a program jax
    serves from its own cache is never kept, so an XLA cache filled without the kept
    store beside it would hold the warm start at tracing speed."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_root(),
                                                                       "compiled")


def native_dir() -> str:
    return os.path.join(cache_root(), "native")


def fingerprint_dir() -> str:
    return os.path.join(cache_root(), "fingerprint")
