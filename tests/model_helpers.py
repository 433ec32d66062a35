"""A tiny single-request paged generator used to check the model on its own."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.models.llama import Llama


@functools.cache
def _prefill_program(cfg, qmatmul=None):
    """`Llama.prefill` as one jitted program kept per config (and product of quantized
    weights): op by op, every op of the model would compile alone."""
    model = Llama(cfg, qmatmul=qmatmul)
    return jax.jit(lambda p, tokens, lengths: model.apply({"params": p}, tokens, lengths,
                                                          method=Llama.prefill))


def paged_greedy(cfg, params, prompt: list[int], num_new: int, page_size: int = 16,
                 bucket: int | None = None, qmatmul=None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens via prefill -> pages -> paged decode; slot 1 stays empty all along.
    `qmatmul`: the product of quantized weights (`Llama`'s), in prefill and decode.

    Returns the tokens and the logits of every decode step (for comparison with a
    full forward)."""
    model = Llama(cfg, qmatmul=qmatmul)
    t = len(prompt)
    bucket = bucket or max(16, 1 << (t - 1).bit_length())
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :t] = prompt
    logits, k, v = _prefill_program(cfg, qmatmul)(params, jnp.asarray(tokens), jnp.asarray([t]))
    out = [int(jnp.argmax(logits[0]))]
    total = t + num_new
    num_pages = -(-total // page_size)
    shape = (cfg.num_layers, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    k_pool, v_pool = jnp.zeros(shape), jnp.zeros(shape)
    used = -(-t // page_size)
    pad = used * page_size - k.shape[2]
    if pad > 0:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    k_pool = k_pool.at[:, 1:1 + used].set(k[:, 0, :used * page_size].reshape(shape[0], used, *shape[2:]))
    v_pool = v_pool.at[:, 1:1 + used].set(v[:, 0, :used * page_size].reshape(shape[0], used, *shape[2:]))
    block_tables = np.zeros((2, num_pages), np.int32)
    block_tables[0] = np.arange(1, num_pages + 1)
    step = jax.jit(lambda p, tok, pos, kp, vp, bt: model.apply(
        {"params": p}, tok, pos, kp, vp, bt, method=Llama.decode))
    step_logits = []
    for i in range(num_new - 1):
        pos = t + i
        lg, k_pool, v_pool = step(params, jnp.asarray([out[-1], 0], jnp.int32),
                                  jnp.asarray([pos, 0], jnp.int32), k_pool, v_pool,
                                  jnp.asarray(block_tables))
        step_logits.append(np.asarray(lg[0]))
        out.append(int(jnp.argmax(lg[0])))
    return out, np.stack(step_logits) if step_logits else np.zeros((0, cfg.vocab_size))


def forward_greedy(cfg, params, prompt: list[int], num_new: int) -> list[int]:
    """Greedy tokens by full causal forwards over one buffer of len(prompt) + num_new
    tokens (causal: the unwritten tail changes no earlier logit): one compiled program
    per model, where `paged_greedy` runs the prefill op by op and compiles a decode
    step -- for tests of what is loaded rather than of the paged cache."""
    step = jax.jit(lambda p, t: Llama(cfg).apply({"params": p}, t, method=Llama.forward))
    tokens = np.zeros((1, len(prompt) + num_new), np.int32)
    tokens[0, :len(prompt)] = prompt
    out = []
    for t in range(len(prompt), len(prompt) + num_new):
        out.append(int(jnp.argmax(step(params, jnp.asarray(tokens))[0, t - 1])))
        tokens[0, t] = out[-1]
    return out
