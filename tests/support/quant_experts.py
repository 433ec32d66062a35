"""Expert weights in GGUF block formats, made the way llama.cpp's converter writes a
stacked `ffn_*_exps` tensor, for tests of the kept-quantized mixture of experts; and the
decode step's expert dispatch run on its own (`dispatched`)."""
import gguf
import jax
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


def dispatched(params, rules, mesh, names, x, ids, weights):
    """`engine.programs.experts.decode_experts` over `params["layers_0"]`'s expert weights
    `names`, run as a decode step runs it: inside the dp `shard_map`, rows split over dp."""
    from jax.sharding import PartitionSpec as P

    from jaxpd.engine.programs.experts import decode_experts, param_specs
    from jaxpd.sharding.compat import shard_map
    experts = decode_experts(rules)

    def body(p, x, ids, weights):
        return experts(x, ids, weights, *(p["layers_0"][n] for n in names))
    return jax.jit(shard_map(body, mesh=mesh, axis_names={"dp"},
                             in_specs=(param_specs(params, rules), P("dp"), P("dp"), P("dp")),
                             out_specs=P("dp")))(params, x, ids, weights)


def experts_reference(x, ids, weights, w_gate, w_up, w_down, first_expert: int = 0):
    """`models.moe.grouped_experts` pair by pair in float64 numpy (silu experts): the
    sum over k of weights[t, k] * expert ids[t, k](x[t]), for the experts
    `first_expert` .. `first_expert + E - 1` only."""
    x, ids, weights = (np.asarray(a, np.float64) for a in (x, ids, weights))
    w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for t, k in np.ndindex(*ids.shape):
        e = int(ids[t, k]) - first_expert
        if 0 <= e < w_gate.shape[0]:
            gate = x[t] @ w_gate[e]
            hidden = gate / (1 + np.exp(-gate)) * (x[t] @ w_up[e])
            out[t] += weights[t, k] * (hidden @ w_down[e])
    return out
