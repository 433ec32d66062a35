"""Lazy package exports: names that import their module on first use, so importing a
package loads only what is asked for (above all, no jax for the router's path)."""
from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict) -> tuple[Callable, Callable]:
    """A module-level `__getattr__` and `__dir__` for `package`: `exports` maps each
    public name to the module that defines it."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
