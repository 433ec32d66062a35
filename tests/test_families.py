"""Qwen3, Gemma 2/3 and the mixtures of experts served end to end: greedy tokens equal
transformers' on the same tiny random weights, on disaggregated and colocated meshes,
with prefix caching on and off, at the library's defaults (warm-up, kept executables,
nothing compiled while serving); their configs and checkpoints are checked at load."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.models import checkpoint
from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import Llama
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free
from tests.hf_fixtures import hf_greedy, hf_logits

FAMILIES = ["qwen3", "gemma3", "gemma2", "qwen3_moe", "mixtral", "qwen2_moe"]
# One token, around the 8-token window of the Gemma fixtures, across pages (16) and
# buckets, and a prompt whose decode runs far past the window.
LENGTHS = (1, 7, 8, 9, 17, 40)
NUM_NEW = 6
MESHES = ["prefill=2,decode=2", "prefill=2,decode=2x2", "colocated=4"]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in LENGTHS]


def _greedy(llm, prompts):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
    return [list(o.token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_forward_logits_match_transformers(hf_models, name):
    path, hf_model = hf_models(name)
    loaded = checkpoint.load(path)
    tokens = _prompts(loaded.cfg.vocab_size)[-1]
    ours = jax.jit(lambda p, x: Llama(loaded.cfg).apply({"params": p}, x,   # one program
                                                        method=Llama.forward))(
        loaded.params, jnp.asarray([tokens]))[0]
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf_model, tokens), atol=1e-4,
                               rtol=1e-4)


def _serve(path, mesh, prefix_caching, prompts, monkeypatch):
    """What a user's `LLM()` runs but for the sizes (and `prefix_caching`, None for the
    default): warm-up and kept executables on, no program compiled by a request."""
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
    with LLM(path, mesh=mesh, max_model_len=64, slots_per_shard=2,
             enable_prefix_caching=prefix_caching) as llm, \
            XlaCompiles(on_request_threads=True) as xla:
        got = _greedy(llm, prompts)
        # Again: with the cache on, the second pass reuses the first's pages.
        again = _greedy(llm, prompts)
        assert_all_pages_free(llm)
        assert xla.count == 0
    return got, again


@pytest.mark.slow
@pytest.mark.matrix     # the default run's `COVERING` cases include these meshes
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_moe"])
def test_greedy_matches_transformers_disaggregated(hf_models, name, monkeypatch):
    """One representative per family on prefill=2,decode=2 (the decode mesh's experts
    spread over tp only where it has tp: see the matrix)."""
    path, hf_model = hf_models(name)
    prompts = _prompts(256)
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    got, again = _serve(path, "prefill=2,decode=2", True, prompts, monkeypatch)
    assert got == expected
    assert again == expected


# Every family on every mesh, prefix caching at its default (on for a disaggregated
# mesh, off for a colocated one) and the other way, is the `matrix` marker's (by hand:
# `-m matrix`). The default run serves every family once at the defaults: each but
# qwen2_moe on prefill=2,decode=2x2 (dp and tp on the decode mesh), qwen2_moe on
# colocated=4 (the other MoE families cover 2x2), and qwen3 on prefill=2,decode=2.
COVERING = {(name, "prefill=2,decode=2x2", None) for name in FAMILIES
            if name != "qwen2_moe"} | {
    ("qwen3", "prefill=2,decode=2", None), ("qwen2_moe", "colocated=4", None)}


def _matrix_case(name, mesh, caching):
    marks = [pytest.mark.slow] + ([] if (name, mesh, caching) in COVERING
                                  else [pytest.mark.matrix])
    return pytest.param(name, mesh, caching, marks=marks)


@pytest.mark.parametrize("name,mesh,prefix_caching", [
    _matrix_case(name, mesh, caching) for name in FAMILIES for mesh in MESHES
    for caching in (None, mesh.startswith("colocated"))])
def test_greedy_matches_transformers_on_every_mesh(hf_models, name, mesh, prefix_caching,
                                                   monkeypatch):
    path, hf_model = hf_models(name)
    prompts = _prompts(256, seed=1)
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    got, again = _serve(path, mesh, prefix_caching, prompts, monkeypatch)
    assert got == expected
    assert again == expected


@pytest.mark.slow
@pytest.mark.matrix     # the runner-level check is the default run's (below)
def test_decode_mesh_prefills_short_prompts_of_a_mixture(hf_models, monkeypatch):
    """Prompts under 16 tokens prefilled on the decode mesh (experts over dp x tp, each
    device running its own on every token), the rest handed off: transformers' tokens."""
    path, hf_model = hf_models("qwen3_moe")
    prompts = _prompts(256, seed=2)
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")
    with LLM(path, mesh="prefill=2,decode=2x2", max_model_len=64, slots_per_shard=2,
             local_prefill_below=16) as llm, XlaCompiles(on_request_threads=True) as xla:
        assert _greedy(llm, prompts) == expected
        assert llm.stats()["local_prefills"] == sum(len(p) < 16 for p in prompts) > 0
        assert_all_pages_free(llm)
        assert xla.count == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_num_params_counts_every_weight_and_active_ones_per_token(hf_models, name):
    import jax

    from jaxpd.models.layout import abstract_params

    path, _ = hf_models(name)
    cfg = ModelConfig.from_dir(path)
    shapes, _ = abstract_params(cfg)
    assert cfg.num_params == sum(s.size for s in jax.tree.leaves(shapes))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_layers))
    unread = sparse * (cfg.num_experts - cfg.num_experts_per_tok) * expert
    assert cfg.num_active_params == cfg.num_params - unread
    assert (cfg.num_active_params < cfg.num_params) == cfg.is_moe


def test_decode_roofline_reads_only_routed_experts(hf_models):
    from jaxpd.bench.roofline import decode_cost, experts_touched

    cfg = ModelConfig.from_dir(hf_models("qwen3_moe")[0])
    assert experts_touched(cfg, 1) == pytest.approx(cfg.num_experts_per_tok)
    assert experts_touched(cfg, 10_000) == pytest.approx(cfg.num_experts)
    _, one = decode_cost(cfg, 1, 0)
    _, many = decode_cost(cfg, 10_000, 0)
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert one - kv == pytest.approx(cfg.num_active_params * 4)
    assert many - kv * 10_000 == pytest.approx(cfg.num_params * 4)


@pytest.mark.slow
def test_sliding_window_and_softcap_change_the_output(hf_models):
    """The Gemma fixtures' prompts reach past the window: without it (or without the
    softcaps) the logits differ, so the parity tests do check them."""
    import dataclasses

    for name, change in (("gemma3", dict(sliding_layers=(), sliding_window=None)),
                         ("gemma2", dict(attn_softcap=None, final_softcap=None))):
        loaded = checkpoint.load(hf_models(name)[0])
        tokens = jnp.asarray([_prompts(loaded.cfg.vocab_size)[-1]])
        run = lambda cfg: np.asarray(Llama(cfg).apply({"params": loaded.params}, tokens,
                                                      method=Llama.forward))
        other = dataclasses.replace(loaded.cfg, **change)
        assert np.abs(run(loaded.cfg) - run(other)).max() > 1e-2, name


def _copy_checkpoint(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gpt_neox' \(architecture "
                                         r"'GPTNeoXForCausalLM'\).*qwen3_moe.*MixtralForCausalLM"):
        ModelConfig.from_hf_dict({"model_type": "gpt_neox",
                                  "architectures": ["GPTNeoXForCausalLM"]})


def test_checkpoint_with_more_experts_than_the_config_is_refused(hf_models, tmp_path):
    path = _copy_checkpoint(hf_models("mixtral")[0], tmp_path / "m")
    _edit_config(path, num_local_experts=3)
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.3\.w1\.weight"):
        checkpoint.load(path)


def test_checkpoint_with_fewer_experts_than_the_config_is_refused(hf_models, tmp_path):
    path = _copy_checkpoint(hf_models("qwen3_moe")[0], tmp_path / "m")
    _edit_config(path, num_experts=9)
    # The router [E, D] is read first and names the disagreement.
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight"):
        checkpoint.load(path)


def test_experts_in_a_layer_the_config_calls_dense_are_refused(hf_models, tmp_path):
    path = _copy_checkpoint(hf_models("qwen2_moe")[0], tmp_path / "m")
    _edit_config(path, mlp_only_layers=[0, 1])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\."):
        checkpoint.load(path)


def test_bad_routing_config_names_the_field():
    base = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "moe_intermediate_size": 16}
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict({**base, "num_experts": 4, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="needs num_experts"):
        ModelConfig.from_hf_dict(base)


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,num_experts,axis", [
    (2, 2, 8, ("dp", "tp")), (2, 2, 2, "tp"), (4, 1, 4, "dp"), (1, 4, 8, "tp"),
    (2, 2, 3, None)])
def test_expert_parallel_dispatch_equals_the_grouped_matmuls(dp, tp, num_experts, axis):
    """More experts than devices, fewer, and a count that splits over nothing: the
    decode mesh's expert-parallel layer (all-gather over dp, psum over tp,
    reduce-scatter back) gives every dp shard its own rows' experts' sum."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxpd.models.moe import grouped_experts, route
    from jaxpd.sharding import logical_rules
    from tests.support.quant_experts import dispatched

    mesh = Mesh(np.array(jax.devices()[:dp * tp]).reshape(dp, tp), ("dp", "tp"))
    rules = logical_rules(mesh, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          vocab_size=64, num_experts=num_experts, moe_intermediate_size=16)
    assert dict(rules)["experts"] == axis
    rng = np.random.default_rng(0)
    t, d, f = 8, 16, 16
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    names = ("experts_gate", "experts_up", "experts_down")
    ws = [jnp.asarray(rng.normal(size=s), jnp.float32)
          for s in ((num_experts, d, f), (num_experts, d, f), (num_experts, f, d))]
    weights, ids = route(jnp.asarray(rng.normal(size=(t, num_experts))),
                         min(2, num_experts), True)
    expected = grouped_experts(x, ids, weights, *ws)
    params = jax.device_put({"layers_0": dict(zip(names, ws))},
                            NamedSharding(mesh, P(axis) if axis else P()))
    got = dispatched(params, rules, mesh, names, x, ids, weights)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


def test_held_experts_run_where_they_lie():
    """A decode mesh's own prefill (tokens on every device, experts over dp x tp): each
    device runs its experts on every pair, and one psum is the only collective."""
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxpd.engine.programs.experts import held_experts
    from jaxpd.models.moe import grouped_experts, route
    from jaxpd.sharding import logical_rules

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    rules = logical_rules(mesh, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          vocab_size=64, num_experts=8, moe_intermediate_size=16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(9, 16)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=(8, 16, 16)), jnp.float32) for _ in range(3)]
    weights, ids = route(jnp.asarray(rng.normal(size=(9, 8))), 2, True)
    placed = jax.device_put(ws, NamedSharding(mesh, P(("dp", "tp"))))
    run = jax.jit(held_experts(rules, mesh)).lower(x, ids, weights, *placed).compile()
    np.testing.assert_allclose(np.asarray(run(x, ids, weights, *placed)),
                               np.asarray(grouped_experts(x, ids, weights, *ws)),
                               rtol=1e-5, atol=1e-4)
    assert re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute)\(",
                      run.as_text()) == ["all-reduce"]


@pytest.mark.slow
@pytest.mark.matrix     # `held_experts` itself is the default run's (above)
def test_decode_mesh_prefill_runs_experts_where_they_lie():
    """A prompt prefilled on the decode mesh itself (its `PrefillRunner`, experts split
    over dp x tp) gives the unsharded prefill's K/V and first token; each device runs
    its own experts on every token and one psum sums them."""
    import re

    from jax.sharding import Mesh

    from jaxpd.engine.programs.placement import place_params
    from jaxpd.engine.programs.prefill_runner import PrefillRunner
    from jaxpd.engine.programs.decode_runner import CompileCounter
    from jaxpd.engine.programs.sampler import SamplingArrays
    from jaxpd.models.layout import init_params

    cfg = ModelConfig.from_hf_dict({
        "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    params = init_params(cfg)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    placed, rules, fused = place_params(cfg, params, mesh, jnp.float32, fuse=True)
    assert dict(rules)["experts"] == ("dp", "tp")
    runner = PrefillRunner(cfg, placed, mesh, rules, 16, CompileCounter(), fused=fused,
                           name="local_prefill")
    tokens = np.asarray(_prompts(cfg.vocab_size)[-2][:16], np.int32)[None]
    lengths = np.asarray([16], np.int32)
    program = runner.run_program(tokens, lengths, SamplingArrays.empty(1))
    compiled = program.fn.lower(*program.args).compile()
    first, _, k, v = compiled(*program.args)
    logits, k_ref, v_ref = jax.jit(lambda p, t, n: Llama(cfg).apply(
        {"params": p}, t, n, method=Llama.prefill))(params, jnp.asarray(tokens),
                                                     jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(k), np.asarray(k_ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(v), np.asarray(v_ref), atol=1e-5)
    assert int(np.asarray(first)[0]) == int(jnp.argmax(logits[0]))
    # The sparse layers' collectives: one psum of their outputs each, nothing gathered
    # (GSPMD's own split of the grouped matmuls gathers group sizes and permutes).
    collectives = re.findall(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute)"
                             r"\(.*op_name=\"[^\"]*_experts/", compiled.as_text())
    assert collectives == ["all-reduce"] * cfg.num_layers


@pytest.mark.slow
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (40, 3.0), (300, None)])
def test_windowed_attention_with_a_prefix_equals_one_masked_softmax(window, softcap):
    """The reference cores' window and softcap against a direct masked softmax over the
    whole sequence (prefix, then new tokens), across query blocks and decode."""
    from jaxpd.models.attention import QUERY_BLOCK, causal_attention, paged_attention

    rng = np.random.default_rng(0)
    b, t, c, n, kh, h = 2, QUERY_BLOCK + 20, 24, 4, 2, 8
    prefix_len = np.array([24, 8])
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, t, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, t, kh, h)).astype(np.float32)
    kp = rng.normal(size=(b, c, kh, h)).astype(np.float32)
    vp = rng.normal(size=(b, c, kh, h)).astype(np.float32)
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      (jnp.asarray(kp), jnp.asarray(vp),
                                       jnp.asarray(prefix_len)), window, softcap))
    for row in range(b):
        keys = np.concatenate([kp[row, :prefix_len[row]], k[row]])
        vals = np.concatenate([vp[row, :prefix_len[row]], v[row]])
        keys, vals = np.repeat(keys, n // kh, axis=1), np.repeat(vals, n // kh, axis=1)
        scores = np.einsum("TNH,SNH->NTS", q[row], keys) / np.sqrt(h)
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        qpos = prefix_len[row] + np.arange(t)[:, None]
        kpos = np.arange(keys.shape[0])[None, :]
        mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        scores = np.where(mask, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("NTS,SNH->TNH", p / p.sum(-1, keepdims=True), vals)
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-5)
        # The last query as one decode step over pages of 4 (page 0: the null page).
        seq_k, seq_v = np.concatenate([kp[row, :prefix_len[row]], k[row]]), \
            np.concatenate([vp[row, :prefix_len[row]], v[row]])
        pages = -(-len(seq_k) // 4)
        pool_k = np.zeros((pages + 1, 4, kh, h), np.float32)
        pool_v = np.zeros_like(pool_k)
        pool_k.reshape(-1, kh, h)[4:4 + len(seq_k)] = seq_k
        pool_v.reshape(-1, kh, h)[4:4 + len(seq_v)] = seq_v
        out = paged_attention(jnp.asarray(q[row, -1:]), jnp.asarray(pool_k),
                              jnp.asarray(pool_v), jnp.arange(1, pages + 1)[None],
                              jnp.asarray([len(seq_k)]), window, softcap)
        np.testing.assert_allclose(np.asarray(out)[0], want[-1], rtol=1e-4, atol=1e-5)
