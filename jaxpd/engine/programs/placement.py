"""Params onto a mesh, in the layout the runners' programs read.

Checkpoints hold separate q/k/v, gate/up and a 3-D `o_proj`; the decode step runs
faster on one q/k/v matmul, one gate/up matmul and a 2-D `o_proj`
(`models.layout.fuse_params`; XLA:CPU otherwise copies every layer's 3-D `o_proj` to
another layout each step): 1.07x on SmolLM2-135M's batch-32 step on CPU. Prefill of
long prompts gains nothing measurable from it (0.99x at 512 tokens), so only decode
meshes are fused. The fusion happens here, once per mesh, where the params are placed:
the loaded tree and the files stay as they are.

With `scan` the placed tree's runs of equal layers are stacked last
(`models.layout.stack_layers`), each leaf keeping its per-layer sharding behind a new
replicated leading axis, so the programs scan one layer body over them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpd.models.config import ModelConfig
from jaxpd.models import quant
from jaxpd.models.layout import (abstract_params, can_fuse, can_fuse_quantized, fuse_params,
                                 stack_layers)
from jaxpd.sharding import logical_rules, named_shardings


def checkpoint_shardings(cfg: ModelConfig, mesh):
    """Where `place_params` puts the unfused checkpoint tree on `mesh`: load a
    checkpoint straight onto these (`checkpoint.load(shardings=)`) and placing it is
    free."""
    rules = logical_rules(mesh, **cfg.logical_dims())
    _, logical = abstract_params(cfg, fused=False)
    return named_shardings(logical, mesh, rules)


def role_shardings(cfg: ModelConfig, mesh_spec):
    """`checkpoint_shardings` of the one mesh of `mesh_spec` (a prefill-only or
    decode-only mesh spanning processes: `jax.devices()` is every process's)."""
    from jaxpd.sharding import build_meshes

    meshes = build_meshes(mesh_spec)
    return checkpoint_shardings(
        cfg, meshes.prefill if meshes.prefill is not None else meshes.decode)


def place_params(cfg: ModelConfig, params, mesh, dtype, *, fuse: bool, scan: bool = False):
    """`params` (the checkpoint tree) cast to `dtype` and placed on `mesh` ->
    (params, logical rules of the mesh, fused). Fused when `fuse` and the fused tree
    shards correctly on this mesh (`can_fuse`: kv heads split over tp as query heads
    do, and quantized projections that fuse share a format); quantized weights keep
    their stored types. `scan`: runs of equal layers stacked (`stack_layers`), which
    the model then scans. Pass the returned `fused` to the runners."""
    rules = logical_rules(mesh, **cfg.logical_dims())
    fused = fuse and can_fuse(rules) and can_fuse_quantized(params)
    params = quant.cast_floats(params, dtype)
    if fused:
        params = fuse_params(cfg, params)
    _, logical = abstract_params(cfg, dtype, fused)
    # Quantized weights go where their float weights would (`quant.shardings_like`).
    params = quant.place(params, named_shardings(logical, mesh, rules))
    if scan:
        params = stack_layers(cfg, params, stack_sharded)
    return params, rules, fused


def stack_sharded(trees):
    """Equal trees of placed arrays -> one tree of their leaves stacked on a new leading
    axis, each stacked leaf sharded as its layers were (the new axis replicated)."""
    def sharding(leaf):
        s = leaf.sharding
        if isinstance(s, NamedSharding):
            return NamedSharding(s.mesh, PartitionSpec(None, *s.spec), memory_kind=s.memory_kind)
        return None
    out = jax.tree.map(sharding, trees[0])
    return jax.jit(lambda ts: jax.tree.map(lambda *a: jnp.stack(a), *ts),
                   out_shardings=out)(trees)
