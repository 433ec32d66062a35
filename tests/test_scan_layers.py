"""Scanned runs of equal layers (`models.layout.stack_layers`) compute what the unrolled
layers compute: every forward pass, on tiny models whose layers differ (Gemma 3 style
local/global attention, a mixture of experts with dense layers), quantized weights too."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.models import quant
from jaxpd.models.config import ModelConfig
from jaxpd.models.layout import (abstract_params, fuse_params, is_stacked, quantize_params,
                                 stack_layers, unstack_layers)
from jaxpd.models.llama import Llama, layer_runs, stack_key
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free
from tests.hf_fixtures import hf_greedy
from tests.support.quant_experts import quantized_experts

# Local attention on layers 0-2, experts (and a shared one) on layers 2-4: runs of two
# local dense layers, one local sparse and two global sparse ones.
MIXED = ModelConfig(model_type="qwen2_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=5, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=64, qk_norm=True, sliding_window=5,
                    rope_local_theta=10000.0, sliding_layers=(True,) * 3 + (False,) * 2,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=24, sparse_layers=(False,) * 2 + (True,) * 3)
PAGE, PAGES = 4, 24
EXPERTS = {"experts_gate", "experts_up", "experts_down"}


@pytest.fixture(scope="module")
def params():
    """Random weights without `init_params`' compile: normal(0.3) everywhere, norms too."""
    shapes, _ = abstract_params(MIXED)
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype), shapes)


def test_runs_split_at_every_change_of_kind(params):
    assert layer_runs(MIXED) == ((0, 2), (2, 3), (3, 5))
    stacked = stack_layers(MIXED, params)
    assert set(stacked) - {"embed_tokens", "norm", "lm_head"} == {
        stack_key(0, 2), "layers_2", stack_key(3, 5)}
    assert stacked[stack_key(3, 5)]["experts_gate"].shape == (2, 4, 32, 32)
    back = unstack_layers(MIXED, stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                    jax.tree.leaves(params)))


def _passes(cfg: ModelConfig, params, fused: bool, qmatmul=None):
    """forward logits, then extend and decode through a paged pool: every output (one
    program)."""
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 12)).astype(np.int32)
    return jax.jit(lambda p, t: _traced_passes(cfg, p, fused, qmatmul, t))(params, tokens)


def _traced_passes(cfg: ModelConfig, params, fused: bool, qmatmul, tokens):
    model = Llama(cfg, jnp.float32, fused, qmatmul=qmatmul)
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
    for n in range(1):
        logits, *pools = model.apply({"params": params}, tokens[:, n], positions + n, *pools,
                                     step_tables, method=Llama.decode)
        out[f"decode{n}"] = logits
    out["k_pool"], out["v_pool"] = pools
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param("checkpoint", marks=pytest.mark.matrix),
                                    "fused_int8"])
def test_scanned_equals_unrolled(params, layout):
    """forward, extend (with and without a prefix) and decode, local and global layers,
    dense and sparse: the same logits and pools, in the checkpoint layout and in the
    decode mesh's (fused, int8 weights and experts kept in Q8_0 blocks: quantized
    leaves stack too, and the native product reads them in place in the stack where it
    is built, an expert by its index in the stack's layers x experts)."""
    cfg, fused, qmatmul = MIXED, layout != "checkpoint", None
    if fused:
        params = fuse_params(cfg, quantize_params(params))
        for layer in (params[f"layers_{i}"] for i in range(cfg.num_layers)):
            for name in EXPERTS & set(layer):
                layer[name] = quantized_experts(np.asarray(layer[name]),
                                                gguf.GGMLQuantizationType.Q8_0)
        qmatmul = quant.native_matmul if quant.native_available() else None
    unrolled = _passes(cfg, params, fused, qmatmul)
    scanned = _passes(cfg, stack_layers(cfg, params), fused, qmatmul)
    for name, want in unrolled.items():
        np.testing.assert_allclose(np.asarray(scanned[name]), np.asarray(want),
                                   rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.matrix     # the model-level cases above run by default
@pytest.mark.parametrize("name,mesh", [("qwen3_moe", "prefill=2,decode=2x2"),
                                       ("gemma3", "colocated=4"),
                                       ("gemma2", "prefill=2,decode=2")])
def test_every_mesh_scanned_serves_transformers_tokens(hf_models, name, mesh, monkeypatch):
    """`scan_layers="all"` through the engine, warm-up and kept executables on: stacked
    params placed and sharded per layer (experts over dp x tp), the pools in the scan's
    carry, greedy tokens those of transformers, no program compiled by a request and
    every page freed."""
    path, hf_model = hf_models(name)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 9, 17, 40)]
    expected = [hf_greedy(hf_model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
    with LLM(path, mesh=mesh, max_model_len=64, slots_per_shard=2, scan_layers="all") as llm, \
            XlaCompiles(on_request_threads=True) as xla:
        runs = layer_runs(llm.model_config)
        assert is_stacked(llm.engine.decode_runner.params) == any(b - a > 1 for a, b in runs)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
        assert [list(o.token_ids) for o in outs] == expected
        assert_all_pages_free(llm)
        assert xla.count == 0
