"""Mixture-of-experts pieces: top-k routing and grouped expert matmuls.

A sparse layer's router scores every token against the E experts, keeps the top k and
weighs their outputs by the softmax (renormalised over the k where the config says so).
No expert computes a token it was not picked for, and each form below reads only the
experts some token was routed to. The T*k (token, expert) pairs run in one of two forms,
picked per platform when the program is lowered (`jax.lax.platform_dependent`):

- **Tiled** (CPU, `tiled_experts`): the pairs sorted by expert are cut into tiles of
  at most `TILE_ROWS` rows, each within one expert's run, and a loop multiplies each
  tile by its expert's weights (read in place by index). The loop runs only the tiles
  that hold pairs, so a decode step reads each routed expert once (for all its rows)
  and no other. XLA:CPU has no grouped matmul kernel: its `ragged_dot` costs about k
  times a dense product over every expert.
- **Grouped** (other platforms, `ragged_experts`): `jax.lax.ragged_dot` over the sorted
  pairs, each expert one contiguous run of rows; a call with fewer pairs than experts
  gathers each pair's expert weights instead, reading only the routed experts.

`grouped_experts` can be handed a slice of the experts (`first_expert`): pairs routed
elsewhere are sorted past the last group and weigh nothing. Summing every slice's output
over the devices that hold the slices is expert parallelism (`jaxpd.engine.programs.experts`).

Each expert weight is a float array or a `models.quant.QuantizedWeight` kept in its
GGUF block format (`EXPERT_IN_DIMS`: gate/up [E, D, F'] and down [E, F', D], each
contracting dim 1; stored experts first, output channels, then the blocks). A quantized
one is dequantized inside the product, only the experts a tile or a gathered pair reads
(the grouped form: every expert held, since `ragged_dot` takes them whole), or goes
through the native CPU product (`native`, `models.quant.native_matmul`'s signature)
one call per tile, reading the expert's blocks in place. The leading dim of every part
is the expert, so slicing or sharding the experts slices the scales with their blocks.
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
# Rows of one tile of the tiled form: each tile is one product against one expert, and
# the native product takes up to this many rows.
TILE_ROWS = NATIVE_MAX_ROWS


def num_held(w) -> int:
    """Experts an expert weight holds here (its leading size), float or quantized."""
    return (w.data if is_quantized(w) else w).shape[0]


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
                    w_gate_EDF, w_up_EDF, w_down_EFD, first_expert=0,
                    activation: str = "silu", native: Callable | None = None
                    ) -> jnp.ndarray:
    """sum over k of weights[t, k] * expert ids[t, k](x[t]) -> [T, D], each expert a
    gated MLP down(act(x gate) * up x), for the experts `first_expert` ..
    `first_expert + E - 1` held here (E = w_gate's leading size; `first_expert` may be
    traced); pairs routed to other experts contribute zero. Each weight float or
    quantized (`EXPERT_IN_DIMS`). `native`: the product of a quantized weight
    (`models.quant.native_matmul`'s signature, its `layer` naming the expert), given
    only on CPU: `tiled_experts` then multiplies quantized experts through it. Without
    it the form is picked per platform: `tiled_experts` on CPU, `ragged_experts`
    elsewhere."""
    args = (x_TD, ids_TK, weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert)
    if native is not None and is_quantized(w_gate_EDF):
        return tiled_experts(*args, activation, native)
    return jax.lax.platform_dependent(
        *args[:6], jnp.asarray(first_expert, jnp.int32),
        cpu=lambda *a: tiled_experts(*a, activation),
        default=lambda *a: ragged_experts(*a, activation))


def _pairs(ids_TK, weights_TK, w_gate, first_expert, dtype):
    """(expert index here [T, k], held here [T, k], weight [T, k] in `dtype`, zero for
    pairs routed to experts not held here)."""
    local = ids_TK - first_expert
    held = (local >= 0) & (local < num_held(w_gate))
    return local, held, jnp.where(held, weights_TK, 0.0).astype(dtype)


def tiled_experts(x_TD, ids_TK, weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                  first_expert=0, activation: str = "silu", native: Callable | None = None):
    """`grouped_experts` in tiles (the CPU form): the held pairs sorted by expert; expert
    j's run of n_j rows is ceil(n_j / G) tiles of G rows from its run's start (G =
    min(T, `TILE_ROWS`), so a decode step's run is one tile), at most ceil(T*k / G) + E
    tiles in all; a loop over the tiles that exist multiplies each by its expert,
    rows past the run masked out. A quantized expert goes through `native` where given
    and it serves, else is dequantized expert by expert."""
    t, k = ids_TK.shape
    m, d, e = t * k, x_TD.shape[1], num_held(w_gate_EDF)
    local, held, weight_TK = _pairs(ids_TK, weights_TK, w_gate_EDF, first_expert,
                                    x_TD.dtype)
    act = ACTIVATIONS[activation]
    g = min(t, TILE_ROWS)
    group = jnp.where(held, local, e).reshape(-1)        # other experts' pairs sort last
    order = jnp.argsort(group, stable=True)                               # [M]
    sizes = jnp.bincount(group, length=e + 1)[:e]                         # [E]
    starts = jnp.cumsum(sizes) - sizes
    tiles = (sizes + g - 1) // g
    ends = jnp.cumsum(tiles)
    n = jnp.arange(-(-m // g) + min(e, m))
    # The expert whose tiles cover tile n: how many experts' tiles end at or before it.
    count = jnp.sum(ends[None, :] <= n[:, None], axis=1)
    tile_expert = jnp.minimum(count, e - 1)
    tile_start = starts[tile_expert] + (n - (ends - tiles)[tile_expert]) * g
    tile_stop = starts[tile_expert] + sizes[tile_expert]
    # Padded by a tile so no tile's slice runs off the end (a clamped start would shift).
    rows = jnp.pad(x_TD[order // k], ((0, g), (0, 0)))                    # [M+G, D]
    weight = jnp.pad(weight_TK.reshape(-1)[order], (0, g))                # [M+G]

    def product(x_GI, w, j):
        if not is_quantized(w):
            return x_GI @ jax.lax.dynamic_index_in_dim(w, j, keepdims=False)
        if native is not None:
            y = native(x_GI, w, layer=j)
            if y is not None:
                return y.astype(x_GI.dtype)
        one = dequantize_rows(_take_experts(w, j[None]), x_GI.dtype)[0]   # [O, I]
        return jnp.einsum("GI,OI->GO", x_GI, one)

    def body(i, out):
        j, start = tile_expert[i], tile_start[i]
        x = jax.lax.dynamic_slice_in_dim(rows, start, g)                  # [G, D]
        hidden = act(product(x, w_gate_EDF, j)) * product(x, w_up_EDF, j)  # [G, F]
        y = product(hidden, w_down_EFD, j)                                # [G, D]
        live = start + jnp.arange(g) < tile_stop[i]
        w = jax.lax.dynamic_slice_in_dim(weight, start, g)
        y = jnp.where(live[:, None], y * w[:, None], 0)
        old = jax.lax.dynamic_slice_in_dim(out, start, g)
        return jax.lax.dynamic_update_slice_in_dim(out, old + y, start, 0)

    # Tile 0 runs unconditionally (with no held pairs it is all masked out), so the
    # loop's carry comes out of a tile, varying over every axis the tiles' inputs do
    # inside a `shard_map`.
    out = body(0, jnp.zeros((m + g, d), x_TD.dtype))
    out = jax.lax.fori_loop(1, ends[-1], body, out)
    return jnp.zeros_like(x_TD).at[order // k].add(out[:m])


def ragged_experts(x_TD, ids_TK, weights_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                   first_expert=0, activation: str = "silu"):
    """`grouped_experts` as grouped matmuls (the form for accelerators): each pair's
    expert gathered where there are no more pairs than experts, else `ragged_dot` over
    the pairs sorted by expert."""
    t, k = ids_TK.shape
    e = num_held(w_gate_EDF)
    local, held, weight = (a.reshape(-1) for a in
                           _pairs(ids_TK, weights_TK, w_gate_EDF, first_expert, x_TD.dtype))
    act = ACTIVATIONS[activation]
    if t * k <= e:
        pick = jnp.clip(local, 0, e - 1)
        rows = jnp.repeat(x_TD, k, axis=0)                                # [T*k, D]
        hidden = (act(_gathered_product(rows, w_gate_EDF, pick))
                  * _gathered_product(rows, w_up_EDF, pick))              # [T*k, F]
        out = _gathered_product(hidden, w_down_EFD, pick) * weight[:, None]
        return out.reshape(t, k, -1).sum(axis=1)
    group = jnp.where(held, local, e)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=e + 1)[:e].astype(jnp.int32)
    rows = x_TD[order // k]                                               # [T*k, D]
    hidden = (act(_grouped_product(rows, w_gate_EDF, sizes))
              * _grouped_product(rows, w_up_EDF, sizes))
    out = _grouped_product(hidden, w_down_EFD, sizes) * weight[order][:, None]   # [T*k, D]
    unsorted = jnp.zeros_like(out).at[order].set(out)                     # pair order again
    return unsorted.reshape(t, k, -1).sum(axis=1)


def _gathered_product(x_MI, w, pick_M):
    """Row m of x times expert pick[m]'s weight -> [M, O], reading only the picked
    experts (a quantized weight: only their blocks, dequantized here)."""
    if not is_quantized(w):
        return jnp.einsum("MI,MIO->MO", x_MI, w[pick_M])
    rows = dequantize_rows(_take_experts(w, pick_M), x_MI.dtype)          # [M, O, I]
    return jnp.einsum("MI,MOI->MO", x_MI, rows)


def _grouped_product(x_MI, w, sizes_E):
    """`ragged_dot` of rows sorted by expert against each group's expert -> [M, O]."""
    if is_quantized(w):
        w = jnp.swapaxes(dequantize_rows(w, x_MI.dtype), 1, 2)           # [E, I, O]
    return jax.lax.ragged_dot(x_MI, w, sizes_E)
