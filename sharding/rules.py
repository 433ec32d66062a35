"""Logical axis -> mesh axis rules for each role.

Models name axes logically (`heads`, `kv_heads`, `mlp`, `vocab`, `embed`, ...). Here
they meet a mesh: everything Megatron splits goes over `tp` when the size divides
evenly; a dimension that does not divide (e.g. fewer KV heads than tp) is replicated,
never dropped. `dp` never appears in weight rules: weights are replicated over dp.

Sharding is the bottom layer and knows no model: callers pass the sizes of the split
dimensions (`ModelConfig.logical_dims()` gives them for a model).

Experts (`experts`, `expert_mlp`, `shared_mlp`): on a decode mesh (it has `dp`) the
experts themselves split over every device (dp x tp) when their count divides that,
else over tp or dp alone where it divides -- expert parallelism, each device holding
whole experts (the one exception to weights being replicated over dp); on a prefill
mesh every expert is tensor-parallel over its own hidden size (`expert_mlp`), as a
dense MLP is over `mlp`.
"""
from __future__ import annotations

import flax.linen as nn
from jax.sharding import Mesh


def logical_rules(mesh: Mesh, *, num_heads: int, num_kv_heads: int, intermediate_size: int,
                  vocab_size: int, num_experts: int = 0, moe_intermediate_size: int = 0,
                  shared_expert_intermediate_size: int = 0
                  ) -> tuple[tuple[str, str | None], ...]:
    """(logical axis, mesh axis or None) pairs for weights of these sizes on `mesh`."""
    tp = mesh.shape.get("tp", 1)

    def over_tp(size: int) -> str | None:
        return "tp" if tp > 1 and size % tp == 0 else None

    experts = _experts_axis(mesh, num_experts)
    return (
        ("heads", over_tp(num_heads)),
        ("kv_heads", over_tp(num_kv_heads)),
        ("mlp", over_tp(intermediate_size)),
        ("vocab", over_tp(vocab_size)),
        ("experts", experts),
        ("expert_mlp", None if experts else over_tp(moe_intermediate_size)),
        ("shared_mlp", over_tp(shared_expert_intermediate_size)),
        ("embed", None),
        ("head_dim", None),
        ("batch", None),
        ("length", None),
    )


def replicated_over_tp(mesh: Mesh, **sizes: int) -> dict[str, int]:
    """The sizes (name=size, as `logical_rules` takes them) that `mesh`'s tp, when more
    than one device, does not divide: each of its devices holds and computes them whole.
    That serves correctly (prefill and decode programs, handoffs and shard offers
    read each dimension's split from the rules), only without tp's gain there."""
    tp = mesh.shape.get("tp", 1)
    return {name: size for name, size in sizes.items() if tp > 1 and size and size % tp}


def _experts_axis(mesh: Mesh, num_experts: int):
    """Where a decode mesh's experts go: every device, else tp, else dp (None: each
    device holds them all; on a prefill mesh always None)."""
    if "dp" not in mesh.shape or not num_experts:
        return None
    dp, tp = mesh.shape["dp"], mesh.shape.get("tp", 1)
    if dp > 1 and tp > 1 and num_experts % (dp * tp) == 0:
        return ("dp", "tp")
    if tp > 1 and num_experts % tp == 0:
        return "tp"
    if dp > 1 and num_experts % dp == 0:
        return "dp"
    return None


def named_shardings(logical_specs, mesh: Mesh, rules):
    """Tree of logical PartitionSpecs -> tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
