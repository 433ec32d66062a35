"""Flax Llama-family model: config, forward passes, paged attention, loading.

The exports load lazily (module `__getattr__`): the config and the tokenizer are plain
Python, so the router and request validation use them without loading jax or flax.
"""
from jaxpd.lazy import lazy_exports

_EXPORTS = {"ModelConfig": "jaxpd.models.config", "Llama": "jaxpd.models.llama"}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
