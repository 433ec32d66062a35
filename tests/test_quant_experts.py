"""Mixture-of-experts weights kept in GGUF block formats (`models.moe` with
`models.quant`): the grouped and gathered products equal the float experts they stand
for, on one device, split over a decode mesh's experts (expert parallelism) and over a
prefill mesh's expert hidden size (tensor parallelism), scales placed with their
blocks. The loaded files are `tests/test_gguf_families.py`'s.

Tolerance: a kept weight holds exactly the values its dequantized float holds, so
outputs differ only by summation order (rtol 1e-5 on outputs of size ~100s).
"""
import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.models import quant
from jaxpd.models.moe import grouped_experts, num_held, route
from jaxpd.sharding import logical_rules, named_shardings
from tests.support.quant_experts import dispatched, quantized_experts

Q = gguf.GGMLQuantizationType
NAMES = ("experts_gate", "experts_up", "experts_down")
D, F = 64, 32
# The float layout's logical axes (`models.llama.Block._setup_experts`).
AXES = {"experts_gate": P("experts", "embed", "expert_mlp"),
        "experts_up": P("experts", "embed", "expert_mlp"),
        "experts_down": P("experts", "expert_mlp", "embed")}


def _experts(num_experts: int, qtype, seed: int = 0):
    """(kept weights, their dequantized floats) of `num_experts` random experts."""
    rng = np.random.default_rng(seed)
    floats = [rng.normal(size=s).astype(np.float32) for s in
              ((num_experts, D, F), (num_experts, D, F), (num_experts, F, D))]
    kept = [quantized_experts(w, qtype, name) for w, name in zip(floats, NAMES)]
    return kept, [quant.dequantize(w) for w in kept]


def _tokens(t: int, num_experts: int, k: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(t, D)), jnp.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(t, num_experts))), k, True)
    return x, ids, weights


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(np.abs(np.asarray(want)).max()))


# Q4_1 and Q8_0 run in the loaded files' tests; every format shares `quant`'s unpacking.
@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_0, pytest.param(Q.Q8_0, marks=pytest.mark.matrix),
                                   pytest.param(Q.Q4_1, marks=pytest.mark.matrix)],
                         ids=lambda q: q.name)
def test_kept_experts_equal_their_float_weights(qtype):
    """Two tokens and nine (4 and 18 pairs): with the native CPU product (where it is
    built) every pair's blocks go through the kernel; the jnp form gathers the 4 pairs'
    blocks and runs the 18 as grouped matmuls over the experts held (the loaded
    files' tests run the jnp form whatever is built)."""
    kept, floats = _experts(8, qtype)
    assert num_held(kept[0]) == 8
    run = jax.jit(grouped_experts)
    product = run
    if quant.native_available():
        product = jax.jit(functools.partial(grouped_experts, native=quant.native_matmul))
    for t in (2, 9):
        x, ids, weights = _tokens(t, 8, 2)
        _close(product(x, ids, weights, *kept), run(x, ids, weights, *floats))


# Experts over dp x tp in the default run; over tp or dp alone in the matrix.
@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,num_experts,axis", [
    (2, 2, 8, ("dp", "tp")), pytest.param(2, 2, 2, "tp", marks=pytest.mark.matrix),
    pytest.param(4, 1, 4, "dp", marks=pytest.mark.matrix)])
def test_kept_experts_split_over_a_decode_mesh(dp, tp, num_experts, axis):
    """Placed as the engine places them (`quant.place`, each part where the float
    weight's experts go), dispatched by `engine.programs.experts` inside the dp `shard_map`."""
    mesh = Mesh(np.array(jax.devices()[:dp * tp]).reshape(dp, tp), ("dp", "tp"))
    rules = logical_rules(mesh, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          vocab_size=64, num_experts=num_experts, moe_intermediate_size=F)
    assert dict(rules)["experts"] == axis
    kept, floats = _experts(num_experts, Q.Q4_1)
    x, ids, weights = _tokens(8, num_experts, min(2, num_experts))
    expected = jax.jit(grouped_experts)(x, ids, weights, *floats)
    shardings = named_shardings({"layers_0": {n: AXES[n] for n in NAMES}}, mesh, rules)
    params = quant.place({"layers_0": dict(zip(NAMES, kept))}, shardings)
    gate = params["layers_0"]["experts_gate"]
    split = axis if isinstance(axis, tuple) else (axis,)
    for part in (gate.data, gate.scale, gate.min):     # scales travel with their experts
        assert part.sharding.spec[0] in (axis, split)
    got = dispatched(params, rules, mesh, NAMES, x, ids, weights)
    _close(got, expected)


@pytest.mark.slow
def test_kept_experts_tensor_parallel_on_a_prefill_mesh():
    """No dp: every expert's hidden size splits over tp (gate/up's output channels,
    down's blocks, each with its scales), under GSPMD."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    rules = logical_rules(mesh, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          vocab_size=64, num_experts=4, moe_intermediate_size=F)
    assert dict(rules)["experts"] is None and dict(rules)["expert_mlp"] == "tp"
    kept, floats = _experts(4, Q.Q8_0)
    shardings = named_shardings(dict(zip(NAMES, (AXES[n] for n in NAMES))), mesh, rules)
    params = quant.place(dict(zip(NAMES, kept)), shardings)
    assert params["experts_gate"].data.sharding.spec == P(None, "tp", None)
    assert params["experts_gate"].scale.sharding.spec == P(None, "tp", None)
    assert params["experts_down"].data.sharding.spec == P(None, None, "tp")
    x, ids, weights = _tokens(9, 4, 2)
    got = jax.jit(lambda p, x, i, w: grouped_experts(x, i, w, *(p[n] for n in NAMES)))(
        params, x, ids, weights)
    _close(got, jax.jit(grouped_experts)(x, ids, weights, *floats))
