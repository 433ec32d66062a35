"""jaxpd: prefill/decode disaggregated LLM serving on JAX.

The exports load lazily (module `__getattr__`), so importing `jaxpd` or a pure-Python
part of it (metrics, errors, the router) does not load jax.
"""
import os

# The model, sharding and transfer layers live at the repository root (models/,
# sharding/, transfer/) and install as jaxpd.models, jaxpd.sharding, jaxpd.transfer
# (setup.cfg's package_dir). In a source checkout they are found the same way.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if (not os.path.isdir(os.path.join(os.path.dirname(__file__), "models"))
        and os.path.isfile(os.path.join(_ROOT, "models", "__init__.py"))):
    __path__.append(_ROOT)  # noqa: F821 -- the package's own search path

from jaxpd.lazy import lazy_exports  # noqa: E402 -- after the path is set

_EXPORTS = {
    "LLM": "jaxpd.llm", "generate": "jaxpd.llm",
    "SamplingParams": "jaxpd.sampling_params",
    "CompletionOutput": "jaxpd.outputs", "RequestMetrics": "jaxpd.outputs",
    "StreamDelta": "jaxpd.outputs",
    "default_model_dir": "jaxpd.default_model", "EngineStats": "jaxpd.stats",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
