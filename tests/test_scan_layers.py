"""Scanned runs of equal layers (`models.llama.stack_layers`) compute what the unrolled
layers compute: every forward pass, on tiny models whose layers differ (Gemma 3 style
local/global attention, a mixture of experts with dense layers), quantized weights too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import (Llama, fuse_params, init_params, layer_runs, quantize_params,
                                stack_key, stack_layers, unstack_layers)

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
            num_kv_heads=2, head_dim=8, max_position_embeddings=64)
# Local, local, global, global, global, local: runs of 2, 3 and 1.
GEMMA = ModelConfig(model_type="gemma3_text", num_layers=6, qk_norm=True, norm_plus_one=True,
                    hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
                    sliding_window=5, rope_local_theta=10000.0,
                    sliding_layers=(True, True, False, False, False, True), **BASE)
# One dense layer, then three sparse ones with a shared expert.
MOE = ModelConfig(model_type="qwen2_moe", num_layers=4, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  sparse_layers=(False, True, True, True), **BASE)
PAGE, PAGES = 4, 24


def test_runs_split_at_every_change_of_kind():
    assert layer_runs(GEMMA) == ((0, 2), (2, 5), (5, 6))
    assert layer_runs(MOE) == ((0, 1), (1, 4))
    params = init_params(MOE)
    stacked = stack_layers(MOE, params)
    assert set(stacked) - {"embed_tokens", "norm", "lm_head"} == {"layers_0", stack_key(1, 4)}
    assert stacked[stack_key(1, 4)]["experts_gate"].shape[0] == 3
    back = unstack_layers(MOE, stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))


def _passes(cfg: ModelConfig, params, fused: bool):
    """forward logits, then decode and extend through a paged pool: every output."""
    model = Llama(cfg, jnp.float32, fused)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (2, 12)), jnp.int32)
    out = {"forward": model.apply({"params": params}, tokens, method=Llama.forward)}
    shape = (cfg.num_layers, PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim)
    pools = jnp.zeros(shape), jnp.zeros(shape)
    # Row 0 writes pages 1-3 (12 tokens), row 1 pages 4-6 (9 real tokens).
    tables = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    lengths = jnp.asarray([12, 9], jnp.int32)
    logits, *pools = model.apply({"params": params}, tokens, jnp.zeros(2, jnp.int32), lengths,
                                 *pools, jnp.zeros((2, 0), jnp.int32), tables,
                                 method=Llama.extend)
    out["extend"] = logits
    # Then 4 new tokens per row after a 12-token (3-page) prefix, both rows on row 0's pages.
    prefix = jnp.asarray([[1, 2, 3], [1, 2, 3]], jnp.int32)
    logits, *pools = model.apply({"params": params}, tokens[:, :4], jnp.full(2, 12, jnp.int32),
                                 jnp.asarray([4, 3], jnp.int32), *pools, prefix,
                                 jnp.asarray([[7], [8]], jnp.int32), method=Llama.extend)
    out["extend_prefix"] = logits
    step_tables = jnp.asarray([[1, 2, 3, 7, 9], [1, 2, 3, 8, 10]], jnp.int32)
    positions = jnp.asarray([16, 15], jnp.int32)
    for n in range(3):
        logits, *pools = model.apply({"params": params}, tokens[:, n], positions + n, *pools,
                                     step_tables, method=Llama.decode)
        out[f"decode{n}"] = logits
    out["k_pool"], out["v_pool"] = pools
    return out


@pytest.mark.parametrize("cfg", [GEMMA, MOE], ids=["gemma3", "moe"])
@pytest.mark.parametrize("fused", [False, True], ids=["checkpoint", "fused"])
def test_scanned_equals_unrolled(cfg, fused):
    params = init_params(cfg, seed=1)
    if fused:
        params = fuse_params(cfg, params)
    unrolled = _passes(cfg, params, fused)
    scanned = _passes(cfg, stack_layers(cfg, params), fused)
    for name, want in unrolled.items():
        np.testing.assert_allclose(np.asarray(scanned[name]), np.asarray(want),
                                   rtol=1e-5, atol=1e-5, err_msg=name)


def test_quantized_layers_stack_and_scan():
    cfg = MOE
    params = quantize_params(init_params(cfg, seed=2))
    unrolled = _passes(cfg, params, False)
    scanned = _passes(cfg, stack_layers(cfg, params), False)
    for name, want in unrolled.items():
        np.testing.assert_allclose(np.asarray(scanned[name]), np.asarray(want),
                                   rtol=1e-5, atol=1e-5, err_msg=name)
