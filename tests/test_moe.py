"""A mixture of experts' grouped matmuls (`models.moe`) in both forms against a
pair-by-pair reference: the tiled form CPU programs run (tiles within one expert's run,
several per expert past `TILE_ROWS` rows, a loop over the tiles that hold pairs) and
the grouped form of other platforms (each pair's expert gathered, or `ragged_dot`);
which form a program holds is decided when it is lowered for its platform."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxpd.models.moe import TILE_ROWS, grouped_experts, ragged_experts, route, tiled_experts
from tests.support.quant_experts import experts_reference

D, F = 16, 8


def _case(t: int, num_experts: int, k: int, held: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(t, D)), jnp.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(t, num_experts))), k, True)
    ws = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32)
          for s in ((held, D, F), (held, D, F), (held, F, D))]
    return x, ids, weights, ws


@pytest.mark.parametrize("form", [tiled_experts, ragged_experts], ids=lambda f: f.__name__)
@pytest.mark.parametrize("t,num_experts,k,first,held", [
    (1, 8, 2, 0, 8),        # a decode row: 2 pairs, 8 experts
    (9, 8, 2, 2, 4),        # experts 2..5 held here: pairs routed elsewhere weigh zero
    (3 * TILE_ROWS - 10, 2, 2, 0, 2)])   # every token on both experts: 3 tiles each
def test_both_forms_equal_the_pair_by_pair_sum(form, t, num_experts, k, first, held):
    x, ids, weights, ws = _case(t, num_experts, k, held)
    got = jax.jit(form)(x, ids, weights, *ws, first)
    want = experts_reference(x, ids, weights, *ws, first)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_each_platform_lowers_its_form():
    """CPU: a loop over tiles, no `ragged_dot` (XLA:CPU's costs about k dense products
    over every expert); tpu and cuda: `ragged_dot`, no loop."""
    x, ids, weights, ws = _case(9, 8, 2, 8)
    ops = {}
    for platform in ("cpu", "tpu", "cuda"):
        text = export.export(jax.jit(grouped_experts), platforms=[platform])(
            x, ids, weights, *ws).mlir_module()
        ops[platform] = set(re.findall(r"(?:stablehlo|chlo)\.(while|ragged_dot)", text))
    assert ops == {"cpu": {"while"}, "tpu": {"ragged_dot"}, "cuda": {"ragged_dot"}}
