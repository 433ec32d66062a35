"""Mixture-of-experts pieces: top-k routing and grouped expert matmuls.

A sparse layer's router scores every token against the E experts, keeps the top k and
weighs their outputs by the softmax (renormalised over the k where the config says so).
The experts run as grouped matmuls (`jax.lax.ragged_dot`): the T*k (token, expert)
pairs are sorted by expert, so each expert multiplies one contiguous run of rows, and
no expert computes a token it was not picked for.

A call with fewer (token, expert) pairs than experts -- a decode step of a few tokens --
gathers each pair's expert weights instead: it reads only the routed experts, where
grouped matmuls over every group cost (on XLA:CPU) about as much as all experts.

`grouped_experts` can be handed a slice of the experts (`first_expert`): pairs routed
elsewhere are sorted past the last group, come out of `ragged_dot` as zeros and weigh
nothing. Summing every slice's output over the devices that hold the slices is expert
parallelism (`jaxpd.engine.experts`).

Each expert weight is a float array or a `models.quant.QuantizedWeight` kept in its
GGUF block format (`EXPERT_IN_DIMS`: gate/up [E, D, F'] and down [E, F', D], each
contracting dim 1; stored experts first, output channels, then the blocks). A
quantized one is dequantized inside the product: the gathered form dequantizes only
the routed experts' blocks, the grouped form every expert it holds (a prompt's many
pairs touch most of them anyway). The leading dim of every part is the expert, so
slicing or sharding the experts slices the scales with their blocks.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpd.models.quant import (NATIVE_MAX_ROWS, QuantizedWeight, dequantize_rows,
                                is_quantized)

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# The contraction dim of each expert weight in its float layout (gate/up [E, D, F'],
# down [E, F', D]); the expert and the other dim are output channels.
EXPERT_IN_DIMS = {"experts_gate": (1,), "experts_up": (1,), "experts_down": (1,)}


def num_held(w) -> int:
    """Experts an expert weight holds here (its leading size), float or quantized."""
    return (w.data if is_quantized(w) else w).shape[0]


def _gathered_product(x_MI, w, pick_M, native=None):
    """Row m of x times expert pick[m]'s weight -> [M, O], reading only the picked
    experts (a quantized weight: only their blocks, through `native` one pair at a
    time where it serves, else dequantized here)."""
    if not is_quantized(w):
        return jnp.einsum("MI,MIO->MO", x_MI, w[pick_M])
    if native is not None:
        out = _native_pairs(x_MI, w, pick_M, native)
        if out is not None:
            return out
    rows = dequantize_rows(_take_experts(w, pick_M), x_MI.dtype)          # [M, O, I]
    return jnp.einsum("MI,MOI->MO", x_MI, rows)


def _native_pairs(x_MI, w: QuantizedWeight, pick_M, native):
    """`_gathered_product` by `native` (`models.quant.native_matmul`'s signature): a
    loop over the pairs, each one row against its expert's blocks (dequantized in the
    kernel, never as a float copy); None where `native` does not take such a row."""
    def one(x_I, e):
        part = [None if a is None else jax.lax.dynamic_index_in_dim(a, e, keepdims=False)
                for a in (w.data, w.scale, w.min)]
        expert = QuantizedWeight(*part, fmt=w.fmt, float_shape=w.float_shape[1:],
                                 in_dims=(0,))
        y = native(x_I[None], expert)
        return None if y is None else y[0]

    row = jax.ShapeDtypeStruct(x_MI.shape[1:], x_MI.dtype)
    if jax.eval_shape(one, row, jax.ShapeDtypeStruct((), pick_M.dtype)) is None:
        return None
    return jax.lax.map(lambda pair: one(*pair), (x_MI, pick_M))


def _grouped_product(x_MI, w, sizes_E):
    """`ragged_dot` of rows sorted by expert against each group's expert -> [M, O]."""
    if is_quantized(w):
        w = jnp.swapaxes(dequantize_rows(w, x_MI.dtype), 1, 2)           # [E, I, O]
    return jax.lax.ragged_dot(x_MI, w, sizes_E)


def _take_experts(w: QuantizedWeight, ids) -> QuantizedWeight:
    """Experts `ids` of a quantized expert weight, every part sliced alike."""
    return w.map_out(lambda a: a[ids], (ids.shape[0], *w.float_shape[1:]))


def route(logits_TE: jnp.ndarray, top_k: int, renormalise: bool
          ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32): the k
    largest softmax probabilities, divided by their sum when `renormalise`."""
    probs = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_experts(x_TD: jnp.ndarray, ids_TK: jnp.ndarray, weights_TK: jnp.ndarray,
                    w_gate_EDF: jnp.ndarray, w_up_EDF: jnp.ndarray, w_down_EFD: jnp.ndarray,
                    first_expert=0, activation: str = "silu",
                    native: Callable | None = None) -> jnp.ndarray:
    """sum over k of weights[t, k] * expert ids[t, k](x[t]) -> [T, D], each expert a
    gated MLP down(act(x gate) * up x), for the experts `first_expert` ..
    `first_expert + E - 1` held here (E = w_gate's leading size; `first_expert` may be
    traced); pairs routed to other experts contribute zero. Each weight float or
    quantized (`EXPERT_IN_DIMS`); `native`: the product of a quantized weight
    (`models.quant.native_matmul`) for the gathered pairs, or None (the jnp form)."""
    t, k = ids_TK.shape
    e = num_held(w_gate_EDF)
    local = ids_TK.reshape(-1) - first_expert                          # [T*k]
    held = (local >= 0) & (local < e)
    act = ACTIVATIONS[activation]
    weight = jnp.where(held, weights_TK.reshape(-1), 0.0)
    # With the native product a pair costs one pass over its expert's blocks, so a
    # decode step's pairs gather up to the rows the kernel serves.
    gather_max = (max(e, NATIVE_MAX_ROWS) if native is not None and is_quantized(w_gate_EDF)
                  else e)
    if t * k <= gather_max:
        # Fewer pairs than experts (a decode step of a few tokens): each pair reads its
        # own expert's weights, no more than the routed experts' bytes; grouped
        # matmuls would touch every group.
        pick = jnp.clip(local, 0, e - 1)
        rows = jnp.repeat(x_TD, k, axis=0)                             # [T*k, D]
        hidden = (act(_gathered_product(rows, w_gate_EDF, pick, native))
                  * _gathered_product(rows, w_up_EDF, pick, native))        # [T*k, F]
        out = _gathered_product(hidden, w_down_EFD, pick, native)
        out = out * weight.astype(out.dtype)[:, None]
        return out.reshape(t, k, -1).sum(axis=1)
    group = jnp.where(held, local, e)                 # other experts' pairs sort last
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=e + 1)[:e].astype(jnp.int32)
    rows = x_TD[order // k]                                            # [T*k, D]
    hidden = (act(_grouped_product(rows, w_gate_EDF, sizes))
              * _grouped_product(rows, w_up_EDF, sizes))
    out = _grouped_product(hidden, w_down_EFD, sizes)                  # [T*k, D]
    out = out * weight.astype(out.dtype)[order][:, None]
    unsorted = jnp.zeros_like(out).at[order].set(out)                  # pair order again
    return unsorted.reshape(t, k, -1).sum(axis=1)
