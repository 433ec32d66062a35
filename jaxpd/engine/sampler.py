"""Token sampling inside the jitted steps (greedy, temperature, top-k, top-p).

Each row's key is `fold_in(key(seed), position)`: it depends on the request's seed and
the position of the token being drawn only, so a seeded request samples the same
tokens whatever batch, slot or shard it lands in, and after a preemption/recompute.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits_BV: jnp.ndarray, temperature_B, top_k_B, top_p_B, seeds_B,
           positions_B) -> jnp.ndarray:
    """Next token per row [B] (int32). temperature 0 -> argmax (exact greedy)."""
    logits = logits_BV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The vocabulary sort below costs more than a small model's whole step on CPU:
    # skip it (at run time, one branch executes) when every row is greedy.
    return jax.lax.cond(jnp.any(temperature_B > 0),
                        lambda: _draw(logits, greedy, temperature_B, top_k_B, top_p_B, seeds_B,
                                      positions_B),
                        lambda: greedy)


def _draw(logits, greedy, temperature_B, top_k_B, top_p_B, seeds_B, positions_B):
    scaled = logits / jnp.maximum(temperature_B, 1e-6)[:, None]
    # One descending sort serves both filters.
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    vocab = logits.shape[-1]
    k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)           # [B, 1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < top_p_B[:, None]
    last_kept = jnp.sum(keep, axis=-1, keepdims=True) - 1
    pth = jnp.take_along_axis(sorted_desc, last_kept, axis=-1)
    threshold = jnp.maximum(kth, pth)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
        seeds_B.astype(jnp.uint32), positions_B)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature_B > 0, drawn, greedy)
