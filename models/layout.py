"""The params tree's layouts, and the transforms between them.

`models.llama` declares the checkpoint layout: per layer `layers_<i>` with separate
q/k/v, gate/up and a 3-D `o_proj`. From it:

- `fuse_params`      the fused layout `Llama(fused=True)` reads (one q/k/v weight, one
                     gate/up weight, a 2-D `o_proj`), prepared once where the engine
                     places params (`engine/programs/placement.py`);
- `stack_layers`     each run of equal layers (`llama.layer_runs`) under one
                     `stack_<start>_<stop>` entry with a leading L axis, which the
                     forward passes scan; `unstack_layers` is its inverse;
- `quantize_params`  the weights of `QUANTIZABLE` as int8 (`models.quant`);
- `init_params`, `abstract_params`  random params, or their shapes and logical specs.

Each is a pure function of a params tree; checkpoints on disk keep the checkpoint
layout.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import Llama, layer_runs, stack_key
from jaxpd.models.quant import QuantizedWeight, is_quantized, quantize_int8

# The contraction dims of each weight that may be kept quantized (`models.quant`), in
# the checkpoint layout `llama.Block` declares; the rest are its output channels.
QUANTIZABLE = {"q_proj": (0,), "k_proj": (0,), "v_proj": (0,), "o_proj": (0, 1),
               "gate_proj": (0,), "up_proj": (0,), "down_proj": (0,),
               "embed_tokens": (1,), "lm_head": (0,)}


def is_stacked(params) -> bool:
    """Whether `params` holds a stacked run (`stack_layers`' tree)."""
    return any(name.startswith("stack_") for name in params)


def stack_layers(cfg: ModelConfig, params, stack: Callable | None = None):
    """A params tree (checkpoint or fused layout) -> the same tree with each run of two
    or more equal layers (`layer_runs`) as one `stack_<start>_<stop>` entry whose
    leaves are the layers' leaves stacked on a new leading axis (any pytree: quantized
    weights stack part by part); a lone layer keeps its `layers_<i>` entry. `stack`:
    how a list of equal trees becomes one (default `jnp.stack` leaf by leaf; the engine
    passes one that keeps each leaf's sharding). A run whose layers hold their weights
    differently (a GGUF file's mixed block formats: one layer's weight Q4_K, another's
    Q6_K) stays as its layers, which the model runs one by one."""
    stack = stack or (lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees))
    out = {name: p for name, p in params.items() if not name.startswith("layers_")}
    for start, stop in layer_runs(cfg):
        layers = [params[f"layers_{i}"] for i in range(start, stop)]
        if len(layers) == 1 or not _alike(layers):
            out.update((f"layers_{i}", p) for i, p in zip(range(start, stop), layers))
        else:
            out[stack_key(start, stop)] = stack(layers)
    return out


def _alike(trees) -> bool:
    """Whether trees have one structure (quantized weights' formats included) and
    leaves of one shape and dtype: whether they stack."""
    def signature(tree):
        leaves, structure = jax.tree.flatten(tree)
        return structure, [(tuple(a.shape), a.dtype) for a in leaves]
    first = signature(trees[0])
    return all(signature(t) == first for t in trees[1:])


def unstack_layers(cfg: ModelConfig, params):
    """`stack_layers`' inverse: every layer as its own `layers_<i>` entry."""
    out = {name: p for name, p in params.items() if not name.startswith("stack_")}
    for start, stop in layer_runs(cfg):
        key = stack_key(start, stop)
        if key in params:
            for i in range(start, stop):
                out[f"layers_{i}"] = jax.tree.map(lambda a, j=i - start: a[j], params[key])
    return out


def can_fuse(rules) -> bool:
    """Whether `fuse_params`'s tree shards correctly under these logical rules: its
    qkv weight splits over kv heads, so query heads must split the same way (both over
    tp, or both replicated). Where only query heads divide tp, the checkpoint layout
    keeps them split and k, v replicated instead."""
    rules = dict(rules)
    return rules.get("heads") == rules.get("kv_heads")


def can_fuse_quantized(params) -> bool:
    """Whether `fuse_params` can join this tree's quantized projections: q, k and v
    (and gate and up) each all float or all in one format, as one fused weight is."""
    for name, p in params.items():
        if not name.startswith("layers_"):
            continue
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            kinds = {p[w].fmt if is_quantized(p[w]) else None for w in group if w in p}
            if len(kinds) > 1:
                return False
    return True


def quantize_params(params, fmt: str = "int8"):
    """Every weight of `QUANTIZABLE` in a checkpoint tree as `quantize_int8` makes it
    (`fmt` "int8", the one format made from float weights); norms and biases float."""
    if fmt != "int8":
        raise ValueError(f"float weights quantize to 'int8' only, not {fmt!r}")

    def walk(tree):
        return {name: (walk(v) if isinstance(v, dict) else
                       quantize_int8(v, QUANTIZABLE[name]) if name in QUANTIZABLE and
                       not is_quantized(v) else v)
                for name, v in tree.items()}
    return walk(params)


def fuse_params(cfg: ModelConfig, params):
    """Checkpoint params -> the tree `Llama(fused=True)` reads: per layer `qkv_proj`
    [D, K, N/K + 2, H] (kv head k's query heads k*N/K ..., then its k, then its v),
    `qkv_bias` [K, N/K + 2, H] with attention bias, `gate_up_proj` [D, 2, F], `o_proj`
    [N*H, D]. A pure function, run once where the engine places params on a mesh;
    checkpoints on disk keep the separate projections."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def grouped(wq, wk, wv):    # [..., N, H], [..., K, H] x2 -> [..., K, N/K + 2, H]
        wq = wq.reshape(*wq.shape[:-2], k, n // k, h)
        return jnp.concatenate([wq, wk[..., None, :], wv[..., None, :]], axis=-2)

    def grouped_quantized(wq, wk, wv):   # parts [N, H, X], [K, H, X] x2 -> [K, C, H, X]
        parts = zip(*((w.data, w.scale, w.min) for w in (wq, wk, wv)))
        fused = [None if q is None else jnp.concatenate(
            [q.reshape(k, n // k, *q.shape[1:]), kk[:, None], vv[:, None]], axis=1)
            for q, kk, vv in parts]
        return QuantizedWeight(*fused, fmt=wq.fmt, float_shape=(d, k, n // k + 2, h),
                               in_dims=(0,))

    def layer(p):
        p = dict(p)
        q, kk, v = p.pop("q_proj"), p.pop("k_proj"), p.pop("v_proj")
        p["qkv_proj"] = (grouped_quantized(q, kk, v) if is_quantized(q) else grouped(q, kk, v))
        if cfg.attention_bias:
            p["qkv_bias"] = grouped(p.pop("q_bias"), p.pop("k_bias"), p.pop("v_bias"))
        o = p["o_proj"]
        p["o_proj"] = (QuantizedWeight(o.data, o.scale, o.min, o.fmt, (n * h, d), (0,))
                       if is_quantized(o) else o.reshape(n * h, d))   # same stored rows
        if "gate_proj" in p:     # a sparse layer's experts keep their layout
            gate, up = p.pop("gate_proj"), p.pop("up_proj")
            if is_quantized(gate):
                p["gate_up_proj"] = QuantizedWeight(
                    *(None if a is None else jnp.stack([a, b]) for a, b in
                      zip((gate.data, gate.scale, gate.min), (up.data, up.scale, up.min))),
                    fmt=gate.fmt, float_shape=(d, 2, cfg.intermediate_size), in_dims=(0,))
            else:
                p["gate_up_proj"] = jnp.stack([gate, up], axis=1)
        return p

    return {name: layer(p) if name.startswith("layers_") else p for name, p in params.items()}


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, fused: bool = False):
    """Shapes/dtypes of the params tree (no allocation) and its logical PartitionSpecs;
    `fused`: of the tree `fuse_params` makes."""
    model = Llama(cfg, dtype, fused)
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                              method=Llama.forward))["params"]
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Random params (normal(0.02) matrices, unit norms): tests and the placeholder model."""
    model = Llama(cfg, dtype)
    # One program: run op by op, every initializer of another shape compiles alone.
    init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 1), jnp.int32),
                                          method=Llama.forward))
    return nn.unbox(init(jax.random.PRNGKey(seed))["params"])
