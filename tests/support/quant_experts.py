"""Expert weights in GGUF block formats, made the way llama.cpp's converter writes a
stacked `ffn_*_exps` tensor, for tests of the kept-quantized mixture of experts."""
import gguf
import jax.numpy as jnp
import numpy as np

from jaxpd.models import quant


def quantized_experts(w_EIO: np.ndarray, qtype: gguf.GGMLQuantizationType,
                      name: str = "experts") -> quant.QuantizedWeight:
    """A float expert weight [E, I, O] (contracting I) as GGUF stores it ([E, O, I]
    rows quantized along I by `gguf.quants.quantize`), read back as the loader reads
    it: parts [E, O, X], float_shape [E, I, O], contracting dim 1."""
    e, i, o = w_EIO.shape
    rows = np.ascontiguousarray(np.swapaxes(np.asarray(w_EIO, np.float32), 1, 2)).reshape(e * o, i)
    raw = gguf.quants.quantize(rows, qtype)
    fmt = quant.GGUF_FORMATS[qtype.name]
    parts = quant.from_gguf_rows(raw.reshape(-1), fmt, e * o, i, name)
    return quant.QuantizedWeight(*(None if a is None else jnp.asarray(a.reshape(e, o, -1))
                                   for a in parts),
                                 fmt=fmt, float_shape=(e, i, o), in_dims=(1,))
