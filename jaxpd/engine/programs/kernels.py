"""Attention kernels placed on a role's mesh: a Pallas or native kernel is opaque to
GSPMD (which would gather a sharded operand onto every device for it), so each runs
under `shard_map` on each device's own heads."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxpd.models.attention import causal_attention
from jaxpd.sharding.compat import shard_map


def prefill_attention(impl: str, mesh: Mesh, rules, head_dim: int):
    """A prompt's causal attention for a resolved `attention_impl` on `mesh`: the native
    kernel where it serves this head dim here (`native_attention.prefill_available`:
    AVX-512), run on each device's own kv heads (and their query heads); else the
    reference. Opaque to GSPMD like the decode kernels (`kernel_per_tp_shard`): every
    mesh axis is manual, the heads split over kv heads' axis as the rules split them
    (replicated when they do not divide tp), the rest of the prompt replicated, as a
    prefill's activations are."""
    if impl != "native":
        return causal_attention
    from jaxpd.models import native_attention
    if not native_attention.prefill_available(head_dim):
        return causal_attention
    heads = P(None, None, dict(rules).get("kv_heads"), None)       # [B, T, N or K, H]

    def per_shard(q, k, v):
        return shard_map(native_attention.causal_attention_native, mesh=mesh,
                         in_specs=(heads, heads, heads), out_specs=heads,
                         axis_names=set(mesh.axis_names), check_vma=False)(q, k, v)
    return per_shard


def prefix_attention(impl: str, mesh: Mesh, rules, head_dim: int):
    """A prefill with context's attention over its cached prefix for a resolved
    `attention_impl` on `mesh` (`Llama.prefix_attention`): the native kernel reading the
    prefix in place from the pools where `prefill_attention` would be native, run on
    each device's own kv heads as it is; else None (the model gathers the prefix and
    runs the reference)."""
    if prefill_attention(impl, mesh, rules, head_dim) is causal_attention:
        return None
    from jaxpd.models import native_attention
    kv_axis = dict(rules).get("kv_heads")
    heads, pools, whole = P(None, None, kv_axis, None), P(None, None, None, kv_axis, None), P()

    def per_shard(q, k, v, k_pool, v_pool, layer, prefix_tables, prefix_len):
        return shard_map(native_attention.prefix_attention_native, mesh=mesh,
                         in_specs=(heads, heads, heads, pools, pools, whole, whole, whole),
                         out_specs=heads, axis_names=set(mesh.axis_names), check_vma=False)(
            q, k, v, k_pool, v_pool, jnp.asarray(layer, jnp.int32), prefix_tables, prefix_len)
    return per_shard


def extend_attention(impl: str, kv_axis: str | None, head_dim: int):
    """A decode mesh's prefill with context (`DecodeRunner.extend`, inside its dp
    `shard_map`): (the prompt core, the prefix core or None) as `Llama` takes them,
    native on each tp shard's own kv heads where `prefill_attention` would be native
    (AVX-512, head dim 32/64/128), else (the reference, None). Like
    `kernel_per_tp_shard`, for the body's abstract mesh (dp already manual)."""
    from jaxpd.models import native_attention
    if impl != "native" or not native_attention.prefill_available(head_dim):
        return causal_attention, None
    heads, pools, whole = P(None, None, kv_axis, None), P(None, None, None, kv_axis, None), P()

    def prompt(q, k, v):
        return shard_map(native_attention.causal_attention_native,
                         mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                         check_vma=False, in_specs=(heads,) * 3, out_specs=heads)(q, k, v)

    def prefix(q, k, v, k_pool, v_pool, layer, prefix_tables, prefix_len):
        return shard_map(native_attention.prefix_attention_native,
                         mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                         check_vma=False,
                         in_specs=(heads, heads, heads, pools, pools, whole, whole, whole),
                         out_specs=heads)(q, k, v, k_pool, v_pool, jnp.asarray(layer, jnp.int32),
                                          prefix_tables, prefix_len)
    return prompt, prefix


def prefill_kernel(attention) -> str:
    """The name of the core `prefill_attention` returned: "native" or "reference"."""
    return "reference" if attention is causal_attention else "native"


def kernel_per_tp_shard(attention, kv_axis: str | None):
    """`attention` (a Pallas or native kernel) run on each tp shard's own kv heads. A kernel is
    opaque to GSPMD, which would gather a kv-head-sharded pool onto every device for
    it, and to jax's varying-axes check (`check_vma`), which cannot type its output
    (so the step that calls it runs without the check too). Each shard already holds
    the query heads of its kv heads (N and K split alike); with kv heads replicated
    (`kv_axis` None), every shard computes them all. Called inside the step's dp
    shard_map, so the mesh is that body's (dp already manual)."""
    heads, pool, whole = P(None, kv_axis, None), P(None, None, kv_axis, None), P()
    if getattr(attention, "whole_pool", False):      # (q, pools [L, ...], layer, tables, lengths)
        layers = P(None, None, None, kv_axis, None)

        def per_shard_layer(q, k_pool, v_pool, layer, *rest):
            # The layer is an operand: a scan over layers passes a traced index.
            return shard_map(functools.partial(_at_layer, attention),
                             mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                             check_vma=False,
                             in_specs=(heads, layers, layers, whole, whole, whole),
                             out_specs=heads)(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32),
                                              *rest)
        per_shard_layer.whole_pool = True
        return per_shard_layer

    def per_shard(*args):
        return shard_map(attention, mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                         check_vma=False, in_specs=(heads, pool, pool, whole, whole),
                         out_specs=heads)(*args)
    return per_shard


def _at_layer(attention, q, k_pool, v_pool, layer, block_tables, lengths):
    return attention(q, k_pool, v_pool, layer, block_tables, lengths)
