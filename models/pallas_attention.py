"""Paged decode attention as Pallas kernels, one per backend, and the choice between them.

Every core here has the signature of the `jnp` reference, which stays the ground truth
(`models/attention.py`): q [B, N, H], pools [P, page_size, K, H], block_tables
[B, max_pages], lengths [B] (>= 1; the decode step passes positions + 1) -> [B, N, H].

- `pallas_gpu`: our kernel, Triton lowering. Grid (B, K): one program per slot and kv
  head takes the G query heads of that kv head together (padded to 16 rows, the
  smallest `dot` Triton takes), walks the slot's pages `pages_per_block` at a time
  with an online softmax, and stops at the slot's length, so pages past it are never
  read. It reads the pool in place (one kv head of a page is `page_size` rows of H,
  strided by K*H): no copy per step.
- `pallas_tpu`: the paged attention kernel that ships with JAX
  (`jax.experimental.pallas.ops.tpu.paged_attention`). It wants kv heads first,
  [K, P, page_size, H], so each call transposes the layer's whole pool: a copy per
  layer per step, of the pool, not just the pages in use. It also computes with K and
  V cast to bfloat16 whatever the pool's dtype. Keeping the pool kv-heads-first would
  remove the copy; that changes every writer of the pool (prefill handoff, insert,
  transfer) and is not done here.

`interpret=True` runs either kernel with Pallas' interpreter (the TPU one in its TPU
interpret mode, which simulates VMEM, DMAs and semaphores), so both are checked against
the reference on CPU.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpd.models.attention import paged_attention

# Same finite mask as the reference.
_MASKED = -1e30
# Triton's `dot` wants at least 16 rows; G (query heads per kv head) is often 1 to 8.
_MIN_ROWS = 16

AttentionFn = Callable[..., jnp.ndarray]


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gpu_kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *, pages_per_block: int):
    # One (slot, kv head): lengths [1], tables [max_pages], q / o [G', H],
    # k / v [P, page_size, H] (this kv head of every page).
    from jax.experimental.pallas import triton as plgpu

    rows, h = q_ref.shape
    block_k = pages_per_block * k_ref.shape[1]
    length = lengths_ref[0]
    q = q_ref[...]

    def body(i, carry):
        o, m, l = carry
        pages = tables_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[pages].reshape(block_k, h)
        v = v_ref[pages].reshape(block_k, h)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * (h ** -0.5)  # [G', block_k] f32
        position = i * block_k + jnp.arange(block_k)
        s = jnp.where(position[None, :] < length, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=-1)
        o = alpha[:, None] * o + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
        return o, m_new, l

    init = (jnp.zeros((rows, h), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    # Every block the loop visits holds at least one valid key, so l >= 1 at the end.
    o, _, l = lax.fori_loop(0, pl.cdiv(length, block_k), body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


def paged_attention_gpu(q_BNH, k_pool_PSKH, v_pool_PSKH, block_tables, lengths, *,
                        pages_per_block: int | None = None, interpret: bool = False,
                        num_warps: int = 4, num_stages: int = 2):
    """Pallas (Triton) paged decode attention, same contract as the reference."""
    from jax.experimental.pallas import triton as plgpu

    b, n, h = q_BNH.shape
    num_pages, page_size, kh, _ = k_pool_PSKH.shape
    g = n // kh
    rows = max(_MIN_ROWS, _next_pow2(g))
    if pages_per_block is None:   # about 64 keys per block, within the slot's table
        pages_per_block = min(max(1, 64 // page_size), _next_pow2(block_tables.shape[1]))
    if pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    # The last block may run past the table: pad it with the null page (masked anyway).
    max_pages = -(-block_tables.shape[1] // pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, max_pages - block_tables.shape[1])))
    q = q_BNH.reshape(b, kh, g, h)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - g), (0, 0)))     # [B, K, G', H]
    pool_spec = pl.BlockSpec((num_pages, page_size, None, h), lambda i, j: (0, 0, j, 0))
    row_spec = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, pages_per_block=pages_per_block),
        grid=(b, kh),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)),
                  pl.BlockSpec((None, max_pages), lambda i, j: (i, 0)),
                  row_spec, pool_spec, pool_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q_BNH.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxpd_paged_attention",
    )(lengths.astype(jnp.int32), tables, q, k_pool_PSKH, v_pool_PSKH)
    return out[:, :, :g].reshape(b, n, h)


def paged_attention_tpu(q_BNH, k_pool_PSKH, v_pool_PSKH, block_tables, lengths, *,
                        pages_per_block: int = 8, interpret: bool = False):
    """JAX's Pallas TPU paged attention behind the reference's contract (see the module
    docstring for the per-step transpose and the bfloat16 K/V it computes with)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_kernel

    h = q_BNH.shape[-1]
    pages_per_block = min(pages_per_block, _next_pow2(block_tables.shape[1]))
    # The kernel walks whole blocks of `pages_per_block` pages; pad with the null page.
    max_pages = -(-block_tables.shape[1] // pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, max_pages - block_tables.shape[1])))
    k = jnp.moveaxis(k_pool_PSKH, 2, 0)                        # [K, P, page_size, H]
    v = jnp.moveaxis(v_pool_PSKH, 2, 0)
    q = (q_BNH.astype(jnp.float32) * h ** -0.5).astype(q_BNH.dtype)   # it does not scale
    call = functools.partial(tpu_kernel, q, k, v, lengths.astype(jnp.int32), tables,
                             pages_per_compute_block=pages_per_block)
    if not interpret:
        return call()
    with pltpu.force_tpu_interpret_mode():
        return call()


def decode_attention(impl: str, interpret: bool = False) -> AttentionFn:
    """The paged decode attention core for a resolved `impl` (see `resolve_attention_impl`)."""
    if impl == "reference":
        if interpret:
            raise ValueError("attention_interpret=True needs a Pallas attention_impl, "
                             "not 'reference'")
        return paged_attention
    if impl == "native":
        from jaxpd.models.native_attention import paged_attention_native
        return paged_attention_native
    if impl == "pallas_gpu":
        return functools.partial(paged_attention_gpu, interpret=interpret)
    if impl == "pallas_tpu":
        return functools.partial(paged_attention_tpu, interpret=interpret)
    raise ValueError(f"attention_impl must be 'reference', 'native', 'pallas_gpu' or "
                     f"'pallas_tpu' here, got {impl!r}")
