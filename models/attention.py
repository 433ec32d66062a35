"""Attention cores: causal attention over a contiguous prompt, and paged decode attention.

Reference implementations in `jax.numpy`, written for clarity; scores and softmax in
float32 whatever the activation dtype. GQA: the N query heads are grouped as
K kv heads x G queries per kv head.

Page 0 of every pool is the *null page*: the allocator never hands it out, empty slots
point their whole block table at it, so their (discarded) writes land nowhere that
matters and no branch is needed in the jitted step.
"""
from __future__ import annotations

import jax.numpy as jnp

# Finite, so a fully masked row gives a uniform softmax instead of NaN.
_MASKED = -1e30
# Query tokens per block of a causal prompt: each block attends only to the keys up to
# its own end, so a long prompt computes about half the T x T scores and holds one
# block's of them at a time. On XLA:CPU, 1,024 tokens of the built-in model prefill in
# 126 ms instead of 386 (64: 132 ms, 256: 156 ms; BENCHMARKS.md section 14).
QUERY_BLOCK = 128


def causal_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> jnp.ndarray:
    """q: [B, T, N, H], k, v: [B, T, K, H] -> [B, T, N, H].

    Padding sits after the real tokens, so a causal mask alone keeps every real
    token from seeing it. In blocks of `QUERY_BLOCK` query tokens (static slices: T is
    a compiled bucket); every key a block skips is one its mask would hide.
    """
    t = q.shape[1]
    blocks = [_causal_block(q[:, start:start + QUERY_BLOCK], k[:, :start + QUERY_BLOCK],
                            v[:, :start + QUERY_BLOCK], start)
              for start in range(0, t, QUERY_BLOCK)]
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def _causal_block(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, start: int) -> jnp.ndarray:
    """Queries at positions start, start + 1, ... ([B, T, N, H]) against the keys from
    position 0 ([B, S, K, H], S = start + T) -> [B, T, N, H]."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    q = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h ** -0.5)
    causal = jnp.arange(s)[None, :] <= start + jnp.arange(t)[:, None]     # [T, S]
    scores = jnp.where(causal, scores, _MASKED)
    probs = jax_softmax(scores).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)


def write_pages(pool_LPSKH: jnp.ndarray, layer: int, new_BKH: jnp.ndarray,
                block_tables: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """Write one token per slot into the pool at its position's page and offset."""
    page_size = pool_LPSKH.shape[2]
    slots = jnp.arange(block_tables.shape[0])
    pages = block_tables[slots, positions // page_size]
    return pool_LPSKH.at[layer, pages, positions % page_size].set(new_BKH.astype(pool_LPSKH.dtype))


def paged_attention(q_BNH: jnp.ndarray, k_pool_PSKH: jnp.ndarray, v_pool_PSKH: jnp.ndarray,
                    block_tables: jnp.ndarray, lengths: jnp.ndarray) -> jnp.ndarray:
    """One query token per slot against that slot's pages.

    q: [B, N, H]; pools: [P, S, K, H]; block_tables: [B, max_pages] page ids;
    lengths: [B] number of valid tokens (keys at index >= length are masked).
    Returns [B, N, H].
    """
    b, n, h = q_BNH.shape
    _, s, kh, _ = k_pool_PSKH.shape
    k = k_pool_PSKH[block_tables].reshape(b, -1, kh, h)   # [B, max_pages*S, K, H]
    v = v_pool_PSKH[block_tables].reshape(b, -1, kh, h)
    q = q_BNH.reshape(b, kh, n // kh, h)
    scores = jnp.einsum("BKGH,BSKH->BKGS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h ** -0.5)
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]          # [B, S*]
    scores = jnp.where(valid[:, None, None, :], scores, _MASKED)
    probs = jax_softmax(scores).astype(v.dtype)
    out = jnp.einsum("BKGS,BSKH->BKGH", probs, v)
    return out.reshape(b, n, h)


def write_prompt_pages(pool_LPSKH: jnp.ndarray, layer: int, new_BTKH: jnp.ndarray,
                       block_tables: jnp.ndarray, positions_BT: jnp.ndarray,
                       valid_BT: jnp.ndarray) -> jnp.ndarray:
    """Write T tokens per row into the pool at their positions' pages and offsets;
    padding tokens (`valid` False) go to the null page."""
    page_size = pool_LPSKH.shape[2]
    rows = jnp.arange(block_tables.shape[0])[:, None]
    index = jnp.minimum(positions_BT // page_size, block_tables.shape[1] - 1)
    pages = jnp.where(valid_BT, block_tables[rows, index], 0)
    return pool_LPSKH.at[layer, pages, positions_BT % page_size].set(
        new_BTKH.astype(pool_LPSKH.dtype))


def paged_prefix_attention(q_BTNH: jnp.ndarray, k_pool_PSKH: jnp.ndarray,
                           v_pool_PSKH: jnp.ndarray, block_tables: jnp.ndarray,
                           positions_BT: jnp.ndarray) -> jnp.ndarray:
    """T query tokens per row against that row's pages: token t of row b sees every
    key at a position <= positions[b, t] (a cached prefix, then its own prompt
    causally; the new tokens' K/V must be written first). Returns [B, T, N, H].

    The pages are gathered once; the queries go in blocks of `QUERY_BLOCK`, each
    against the whole width (where the row's prefix ends varies by row, so no block
    can skip keys statically): one block's scores held at a time, which alone made
    1,024 tokens' attention 2.2x faster on XLA:CPU (75 -> 35 ms a layer)."""
    b, t, n, h = q_BTNH.shape
    _, s, kh, _ = k_pool_PSKH.shape
    k = k_pool_PSKH[block_tables].reshape(b, -1, kh, h)   # [B, W*page_size, K, H]
    v = v_pool_PSKH[block_tables].reshape(b, -1, kh, h)
    keys = jnp.arange(k.shape[1])
    blocks = []
    for start in range(0, t, QUERY_BLOCK):
        q = q_BTNH[:, start:start + QUERY_BLOCK]
        tq = q.shape[1]
        q = q.reshape(b, tq, kh, n // kh, h)
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
        scores = scores * (h ** -0.5)
        visible = keys[None, None, :] <= positions_BT[:, start:start + tq, None]   # [B, T, S]
        scores = jnp.where(visible[:, None, None], scores, _MASKED)
        probs = jax_softmax(scores).astype(v.dtype)
        blocks.append(jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(b, tq, n, h))
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def jax_softmax(x: jnp.ndarray) -> jnp.ndarray:
    x = x - jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)
