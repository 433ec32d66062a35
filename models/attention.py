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
# block's of them at a time.
QUERY_BLOCK = 128


def causal_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray,
                     prefix: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray] | None = None,
                     window: int | None = None, softcap: float | None = None
                     ) -> jnp.ndarray:
    """q: [B, T, N, H], k, v: [B, T, K, H] -> [B, T, N, H].

    Padding sits after the real tokens, so a causal mask alone keeps every real
    token from seeing it. In blocks of `QUERY_BLOCK` query tokens (static slices: T is
    a compiled bucket); every key a block skips is one its mask would hide.

    `prefix`: (k [B, C, K, H], v [B, C, K, H], prefix_len [B]): a cached prefix that
    every query of row b sees before its own tokens, its first prefix_len[b] keys (a
    prefill with context, `Llama.extend`). Each block's scores over the prefix and over
    its own causal keys go through one softmax, so the prefix costs T x C and the new
    tokens only their causal half.

    `window`: a query sees only the last `window` keys, itself included (key j of query
    i where i - window < j <= i, positions counted from the prefix's first key);
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask.
    """
    t = q.shape[1]
    if prefix is not None:
        k_prefix, v_prefix, prefix_len = prefix
        visible = (jnp.arange(k_prefix.shape[1])[None, :] < prefix_len[:, None])[:, None, :]
        if window is not None:     # [B, T, C]: query i sits at prefix_len + i
            query_pos = prefix_len[:, None] + jnp.arange(t)[None, :]
            visible = visible & (jnp.arange(k_prefix.shape[1])[None, None, :]
                                 > query_pos[:, :, None] - window)
        prefix = (k_prefix, v_prefix, visible)
    blocks = [_causal_block(q[:, start:start + QUERY_BLOCK], k[:, :start + QUERY_BLOCK],
                            v[:, :start + QUERY_BLOCK], start,
                            _prefix_block(prefix, start), window, softcap)
              for start in range(0, t, QUERY_BLOCK)]
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)


def _prefix_block(prefix, start: int):
    """`prefix` for the query block from `start`: its visibility rows [B, T, C] cut to
    the block's (a [B, 1, C] one serves every block)."""
    if prefix is None or prefix[2].shape[1] == 1:
        return prefix
    return prefix[0], prefix[1], prefix[2][:, start:start + QUERY_BLOCK]


def _causal_block(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, start: int,
                  prefix: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray] | None,
                  window: int | None = None, softcap: float | None = None) -> jnp.ndarray:
    """Queries at positions start, start + 1, ... ([B, T, N, H]) against the keys from
    position 0 ([B, S, K, H], S = start + T), after the visible keys of `prefix`
    (k, v [B, C, K, H], visible [B, T or 1, C]) if given -> [B, T, N, H].

    The softmax is normalised after the values are summed ([T, H] divisions instead of
    [T, S]): fewer whenever the keys outnumber the head dim."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    q = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
    query_pos = start + jnp.arange(t)[:, None]
    causal = jnp.arange(s)[None, :] <= query_pos                          # [T, S]
    if window is not None:
        causal = causal & (jnp.arange(s)[None, :] > query_pos - window)
    scores = jnp.where(causal, _softcapped(scores * (h ** -0.5), softcap), _MASKED)
    if prefix is None:
        weights, total = _unnormalised(scores)
        out = jnp.einsum("BKGTS,BSKH->BKGTH", weights.astype(v.dtype), v)
    else:
        k_prefix, v_prefix, visible = prefix
        c = k_prefix.shape[1]
        cached = jnp.einsum("BTKGH,BCKH->BKGTC", q, k_prefix,
                            preferred_element_type=jnp.float32)
        cached = jnp.where(visible[:, None, None, :, :],
                           _softcapped(cached * (h ** -0.5), softcap), _MASKED)
        weights, total = _unnormalised(jnp.concatenate([cached, scores], axis=-1))
        weights = weights.astype(v.dtype)
        out = (jnp.einsum("BKGTC,BCKH->BKGTH", weights[..., :c], v_prefix)
               + jnp.einsum("BKGTS,BSKH->BKGTH", weights[..., c:], v))
    out = (out / total).astype(v.dtype)                                  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _softcapped(scores: jnp.ndarray, softcap: float | None) -> jnp.ndarray:
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _unnormalised(scores: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """exp(scores - their row max) and its row sums (keepdims): a softmax before its
    division."""
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return e, jnp.sum(e, axis=-1, keepdims=True)


def write_pages(pool_LPSKH: jnp.ndarray, layer: int, new_BKH: jnp.ndarray,
                block_tables: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """Write one token per slot into the pool at its position's page and offset."""
    page_size = pool_LPSKH.shape[2]
    slots = jnp.arange(block_tables.shape[0])
    pages = block_tables[slots, positions // page_size]
    return pool_LPSKH.at[layer, pages, positions % page_size].set(new_BKH.astype(pool_LPSKH.dtype))


def paged_attention(q_BNH: jnp.ndarray, k_pool_PSKH: jnp.ndarray, v_pool_PSKH: jnp.ndarray,
                    block_tables: jnp.ndarray, lengths: jnp.ndarray,
                    window: int | None = None, softcap: float | None = None) -> jnp.ndarray:
    """One query token per slot against that slot's pages.

    q: [B, N, H]; pools: [P, S, K, H]; block_tables: [B, max_pages] page ids;
    lengths: [B] number of valid tokens (keys at index >= length are masked).
    `window`, `softcap` as `causal_attention`'s (the query is the slot's last token).
    Returns [B, N, H].
    """
    b, _, h = q_BNH.shape
    kh = k_pool_PSKH.shape[2]
    k = k_pool_PSKH[block_tables].reshape(b, -1, kh, h)   # [B, max_pages*S, K, H]
    v = v_pool_PSKH[block_tables].reshape(b, -1, kh, h)
    return _attend_one(q_BNH, k, v, lengths, window, softcap)


def paged_attention_at(q_BNH: jnp.ndarray, k_pool_LPSKH: jnp.ndarray,
                       v_pool_LPSKH: jnp.ndarray, layer, block_tables: jnp.ndarray,
                       lengths: jnp.ndarray, window: int | None = None,
                       softcap: float | None = None) -> jnp.ndarray:
    """`paged_attention` on layer `layer` of the whole pools [L, P, S, K, H], `layer` an
    int or a traced int32 (a scan over layers): one gather from the whole pool, as
    `gather_pages` reads, so no layer's pool is sliced out (a copy) first."""
    return _attend_one(q_BNH, gather_pages(k_pool_LPSKH, layer, block_tables),
                       gather_pages(v_pool_LPSKH, layer, block_tables), lengths, window, softcap)


def _attend_one(q_BNH, k, v, lengths, window, softcap):
    """One query per row q [B, N, H] against its gathered keys and values k, v
    [B, S, K, H], the first lengths[b] valid -> [B, N, H]."""
    b, n, h = q_BNH.shape
    kh = k.shape[2]
    q = q_BNH.reshape(b, kh, n // kh, h)
    scores = jnp.einsum("BKGH,BSKH->BKGS", q, k, preferred_element_type=jnp.float32)
    scores = _softcapped(scores * (h ** -0.5), softcap)
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]          # [B, S*]
    if window is not None:
        valid = valid & (jnp.arange(k.shape[1])[None, :] >= lengths[:, None] - window)
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


def gather_pages(pool_LPSKH: jnp.ndarray, layer: int, block_tables: jnp.ndarray) -> jnp.ndarray:
    """Layer `layer`'s pages of `block_tables` [B, W] as one sequence per row:
    [B, W * S, K, H]. One gather from the whole pool: a slice of the layer first would
    be copied out of the pool (the pool's size, every call)."""
    b, w = block_tables.shape
    layers = jnp.full_like(block_tables, layer)
    pages = pool_LPSKH[layers, block_tables]
    return pages.reshape(b, w * pool_LPSKH.shape[2], *pool_LPSKH.shape[3:])


def jax_softmax(x: jnp.ndarray) -> jnp.ndarray:
    x = x - jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)
