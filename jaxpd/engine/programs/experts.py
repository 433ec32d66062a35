"""Expert parallelism for a mixture of experts on the decode mesh.

The decode mesh's rules split the experts over its devices (`sharding.logical_rules`:
`experts` over dp x tp, or whichever of them the count divides), each device holding
E / (dp x tp) whole experts. The decode programs run per dp shard (`shard_map` over
dp, tp inside is GSPMD's), so a sparse layer:

1. all-gathers its shard's (token, routing) rows over dp, so every dp shard sees every
   token of the step (a step's rows are few: one token per slot);
2. runs, on each device, its own experts on the pairs routed to them
   (`moe.grouped_experts` with its `first_expert`; pairs routed elsewhere weigh zero),
   the tokens already being on every tp device of the shard (activations are
   replicated over tp), then one psum over tp;
3. reduce-scatters the sums over dp, each shard getting back its own rows.

A prompt prefilled on the decode mesh itself (its own `PrefillLoop`) runs under GSPMD
with every token on every device (`held_experts`): each device runs its experts on
all the pairs and one psum over the expert axes sums them, so there is nothing to
gather or scatter.

Only activations cross devices, never an expert's weights. An expert weight kept
quantized (`models.moe`) splits the same way: each of its parts leads with the expert,
so a device holds its experts' blocks and their scales. The prefill mesh has no dp:
its experts are tensor-parallel over `expert_mlp` instead, under GSPMD.
"""
from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxpd.models.moe import grouped_experts, num_held
from jaxpd.sharding.compat import shard_map

EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def _axes(rules) -> tuple[str, ...]:
    axis = dict(rules).get("experts")
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def param_specs(params, rules):
    """The `shard_map` in_specs over dp of a decode program's params: expert weights
    split over dp where the rules split experts over it (each shard gets its own
    experts), everything else whole (replicated over dp)."""
    over_dp = "dp" in _axes(rules)

    def spec(path, _):   # a quantized expert weight's parts all lead with the expert
        if not over_dp or not any(getattr(k, "key", None) in EXPERT_WEIGHTS for k in path):
            return P()
        # A stacked run (`models.layout.stack_layers`) leads with its layer axis.
        stacked = str(getattr(path[0], "key", "")).startswith("stack_")
        return P(None, "dp") if stacked else P("dp")
    return jax.tree_util.tree_map_with_path(spec, params)


def decode_experts(rules, native=None):
    """The `experts` callable (`moe.grouped_experts`'s signature) for a program run
    inside a decode mesh's dp `shard_map`, its params split by `param_specs`:
    expert-parallel over the axes `experts` maps to; the plain grouped matmuls when
    experts are not split. The callable takes the product of quantized weights each
    call (`native`, as `moe.grouped_experts`); `native` here is the one the mesh's
    programs pass (`models.quant.native_matmul`) or None, refused where experts split
    over tp."""
    axes = _axes(rules)
    if native is not None and "tp" in axes:
        raise ValueError("the native product of quantized weights is opaque to GSPMD: "
                         "it cannot serve experts split over tp")
    if not axes:
        return grouped_experts
    over_dp, over_tp = "dp" in axes, "tp" in axes

    def parallel(x, ids, weights, w_gate, w_up, w_down, first_expert=0, activation="silu",
                 native=None):
        first = 0
        if over_dp:     # this shard holds experts [dp_index * E', (dp_index + 1) * E')
            first = jax.lax.axis_index("dp") * num_held(w_gate)
            x, ids, weights = (jax.lax.all_gather(a, "dp", tiled=True)
                               for a in (x, ids, weights))
        if over_tp:
            whole, split = P(), P("tp")
            out = shard_map(functools.partial(_tp_experts, activation),
                            mesh=jax.sharding.get_abstract_mesh(), axis_names={"tp"},
                            check_vma=False,
                            in_specs=(whole, whole, whole, split, split, split, whole),
                            out_specs=whole)(x, ids, weights, w_gate, w_up, w_down, first)
        else:
            out = grouped_experts(x, ids, weights, w_gate, w_up, w_down, first, activation,
                                  native)
        if over_dp:
            out = jax.lax.psum_scatter(out, "dp", scatter_dimension=0, tiled=True)
        return out
    return parallel


def _tp_experts(activation, x, ids, weights, w_gate, w_up, w_down, first):
    first = first + jax.lax.axis_index("tp") * num_held(w_gate)
    out = grouped_experts(x, ids, weights, w_gate, w_up, w_down, first, activation)
    return jax.lax.psum(out, "tp")


def held_experts(rules, mesh):
    """The `experts` callable for a GSPMD program on a decode mesh whose tokens are
    replicated (a prompt prefilled on the decode mesh), params placed by the mesh's
    rules: each device runs the experts it holds on every (token, expert) pair, then a
    psum over the axes `experts` maps to, where GSPMD's own split of the grouped
    matmuls would gather group sizes and permute between devices in every sparse
    layer. The plain grouped matmuls where experts are not split."""
    axes = _axes(rules)
    if not axes:
        return grouped_experts
    split, whole = P(axes), P()

    def parallel(x, ids, weights, w_gate, w_up, w_down, first_expert=0, activation="silu",
                 native=None):
        # `native` is None here: the program runs under GSPMD, where the product is opaque.
        return shard_map(functools.partial(_own_experts, axes, mesh.shape, activation),
                         mesh=mesh, in_specs=(whole,) * 3 + (split,) * 3 + (whole,),
                         out_specs=whole, check_vma=False)(
            x, ids, weights, w_gate, w_up, w_down, first_expert)
    return parallel


def _own_experts(axes, sizes, activation, x, ids, weights, w_gate, w_up, w_down, first):
    index = 0
    for axis in axes:     # the experts' split is major to minor in `axes`' order
        index = index * sizes[axis] + jax.lax.axis_index(axis)
    first = first + index * num_held(w_gate)
    out = grouped_experts(x, ids, weights, w_gate, w_up, w_down, first, activation)
    return jax.lax.psum(out, axes)
