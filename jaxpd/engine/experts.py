"""Expert parallelism for a mixture of experts on the decode mesh.

The decode mesh's rules split the experts over tp (`sharding.logical_rules`: each
device holds E / tp whole experts). A step's tokens are already on every tp device
(activations are replicated over tp), so the dispatch is an all-gather that costs
nothing: each device runs its own experts on the (token, expert) pairs routed to them
(`moe.grouped_experts` with its `first_expert`), pairs routed elsewhere weigh zero, and
one psum over tp adds the experts' outputs. Only the [T, D] result crosses devices,
never an expert's weights.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxpd.models.moe import grouped_experts
from jaxpd.sharding.compat import shard_map


def decode_experts(rules):
    """The `experts` callable (`moe.grouped_experts`'s signature) for a program on a
    decode mesh with these logical rules: expert-parallel over the axis `experts` maps
    to, inside the step's dp `shard_map` (so the mesh is that body's); the plain
    grouped matmuls when experts are not split."""
    axis = dict(rules).get("experts")
    if axis is None:
        return grouped_experts

    def parallel(x, ids, weights, w_gate, w_up, w_down, first_expert=0, activation="silu"):
        local = functools.partial(_local_experts, axis, activation)
        whole, split = P(), P(axis)
        return shard_map(local, mesh=jax.sharding.get_abstract_mesh(), axis_names={axis},
                         check_vma=False, in_specs=(whole, whole, whole, split, split, split),
                         out_specs=whole)(x, ids, weights, w_gate, w_up, w_down)
    return parallel


def _local_experts(axis, activation, x, ids, weights, w_gate, w_up, w_down):
    first = jax.lax.axis_index(axis) * w_gate.shape[0]
    out = grouped_experts(x, ids, weights, w_gate, w_up, w_down, first, activation)
    return jax.lax.psum(out, axis)
