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
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


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
                    first_expert=0, activation: str = "silu") -> jnp.ndarray:
    """sum over k of weights[t, k] * expert ids[t, k](x[t]) -> [T, D], each expert a
    gated MLP down(act(x gate) * up x), for the experts `first_expert` ..
    `first_expert + E - 1` held here (E = w_gate's leading size; `first_expert` may be
    traced); pairs routed to other experts contribute zero."""
    t, k = ids_TK.shape
    e = w_gate_EDF.shape[0]
    local = ids_TK.reshape(-1) - first_expert                          # [T*k]
    held = (local >= 0) & (local < e)
    act = ACTIVATIONS[activation]
    weight = jnp.where(held, weights_TK.reshape(-1), 0.0)
    if t * k <= e:
        # Fewer pairs than experts (a decode step of a few tokens): each pair reads its
        # own expert's weights, no more than the routed experts' bytes; grouped
        # matmuls would touch every group.
        pick = jnp.clip(local, 0, e - 1)
        rows = jnp.repeat(x_TD, k, axis=0)                             # [T*k, D]
        hidden = (act(jnp.einsum("MD,MDF->MF", rows, w_gate_EDF[pick]))
                  * jnp.einsum("MD,MDF->MF", rows, w_up_EDF[pick]))
        out = jnp.einsum("MF,MFD->MD", hidden, w_down_EFD[pick])
        out = out * weight.astype(out.dtype)[:, None]
        return out.reshape(t, k, -1).sum(axis=1)
    group = jnp.where(held, local, e)                 # other experts' pairs sort last
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=e + 1)[:e].astype(jnp.int32)
    rows = x_TD[order // k]                                            # [T*k, D]
    gate = jax.lax.ragged_dot(rows, w_gate_EDF, sizes)
    up = jax.lax.ragged_dot(rows, w_up_EDF, sizes)
    hidden = act(gate) * up
    out = jax.lax.ragged_dot(hidden, w_down_EFD, sizes)                # [T*k, D]
    out = out * weight.astype(out.dtype)[order][:, None]
    unsorted = jnp.zeros_like(out).at[order].set(out)                  # pair order again
    return unsorted.reshape(t, k, -1).sum(axis=1)
