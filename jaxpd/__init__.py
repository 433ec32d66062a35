"""jaxpd: prefill/decode disaggregated LLM serving on JAX."""
from jaxpd.default_model import default_model_dir
from jaxpd.llm import LLM, generate
from jaxpd.outputs import CompletionOutput, RequestMetrics, StreamDelta
from jaxpd.sampling_params import SamplingParams

__all__ = ["LLM", "generate", "SamplingParams", "CompletionOutput", "RequestMetrics",
           "StreamDelta", "default_model_dir"]
