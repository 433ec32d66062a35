"""Logical axis -> mesh axis rules for each role.

Models name axes logically (`heads`, `kv_heads`, `mlp`, `vocab`, `embed`, ...). Here
they meet a mesh: everything Megatron splits goes over `tp` when the size divides
evenly; a dimension that does not divide (e.g. fewer KV heads than tp) is replicated,
never dropped. `dp` never appears in weight rules: weights are replicated over dp.
"""
from __future__ import annotations

import flax.linen as nn
from jax.sharding import Mesh

from models.config import ModelConfig


def logical_rules(cfg: ModelConfig, mesh: Mesh) -> tuple[tuple[str, str | None], ...]:
    tp = mesh.shape.get("tp", 1)

    def over_tp(size: int) -> str | None:
        return "tp" if tp > 1 and size % tp == 0 else None

    return (
        ("heads", over_tp(cfg.num_heads)),
        ("kv_heads", over_tp(cfg.num_kv_heads)),
        ("mlp", over_tp(cfg.intermediate_size)),
        ("vocab", over_tp(cfg.vocab_size)),
        ("embed", None),
        ("head_dim", None),
        ("batch", None),
        ("length", None),
    )


def named_shardings(logical_specs, mesh: Mesh, rules):
    """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
