"""GGUF files of Gemma 2, Gemma 3 and the mixtures of experts (qwen3moe, qwen2moe and
Mixtral, filed as llama with experts) load to the model transformers runs.

Each file is written the way llama.cpp's converter writes it from a tiny random
transformers checkpoint (`tests.support.gguf_files.converter_tensors`: its tensor
names, stacked experts, Gemma's 1 + w norms, q/k permutation for llama). F32: greedy
tokens equal transformers' on the source model, and the config equals the one read
from the checkpoint's config.json. Q8_0 served with quantization="auto" (projections
and stacked experts kept quantized, routers and shared experts float): greedy tokens
equal transformers' on the source model with every weight rounded through Q8_0 as the
file stores it. Q4_1 experts kept quantized give the tokens (and, up to summation
order, the logits) of the same file read as float. Prompts run past Gemma's 8-token
window. Then the files llama.cpp could not have written, or we would run
differently, are refused naming the key or tensor.
"""
import copy
import dataclasses
import logging
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models import checkpoint, source
from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import Llama
from jaxpd.models.quant import dequantize, is_quantized
from tests.hf_fixtures import hf_greedy
from tests.model_helpers import forward_greedy
from tests.support.gguf_files import (converter_metadata, converter_tensors,
                                      random_k_blocks, train_bpe, write_gguf)

Q = gguf.GGMLQuantizationType
# transformers fixture (`tests.hf_fixtures.CONFIGS`) -> llama.cpp architecture.
FAMILIES = {"gemma2_gguf": "gemma2", "gemma3_gguf": "gemma3", "qwen3_moe": "qwen3moe",
            "qwen2_moe_gguf": "qwen2moe", "mixtral": "llama"}
# Gemma 3's one global layer in six needs six layers.
NUM_LAYERS = {"gemma3_gguf": 6}
NUM_NEW = 8
PROMPT_LEN = 21     # past the Gemma fixtures' 8-token window


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


def _source(hf_models, bpe, name):
    return hf_models(name, vocab_size=len(bpe[0]), num_layers=NUM_LAYERS.get(name, 2))


def write_family(tmp_path, hf_models, bpe, name, qtype, tensors=None, extra=None) -> str:
    """`name`'s tiny checkpoint as a GGUF file in `qtype`, as llama.cpp converts it;
    `tensors`/`extra` edit the converter's tensors and metadata (None: left out)."""
    path, model = _source(hf_models, bpe, name)
    cfg, arch = model.config, FAMILIES[name]
    out = converter_tensors(path, cfg, arch)
    out.update(tensors or {})
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    extra = {**converter_metadata(cfg, arch), **(extra or {})}
    return write_gguf(os.path.join(tmp_path, f"{name}-{qtype.name}.gguf"),
                      {k: v for k, v in out.items() if v is not None}, qtype, arch=arch,
                      vocab=bpe, block_count=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                      ffn=cfg.intermediate_size, heads=cfg.num_attention_heads,
                      kv_heads=cfg.num_key_value_heads, head_dim=getattr(cfg, "head_dim", None),
                      rope_theta=rope["rope_theta"], eps=cfg.rms_norm_eps,
                      extra={k: v for k, v in extra.items() if v is not None})


def _prompt(vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, size=PROMPT_LEN).tolist()


def _rounded_through(model, qtype):
    """`model` with every weight the converter writes in `qtype` rounded through it (row
    by row along the contraction, as GGUF stores rows; F16 where a row does not split
    into blocks); norms, routers and the shared expert's gate stay float32."""
    import torch

    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rounded = copy.deepcopy(model)
    state = rounded.state_dict()
    with torch.no_grad():
        for name, w in state.items():
            if w.ndim < 2 or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                continue
            x = w.numpy()
            if x.shape[-1] % block:
                y = x.astype(np.float16).astype(np.float32)
            else:
                y = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
            w.copy_(torch.from_numpy(np.asarray(y, np.float32).reshape(x.shape)))
    return rounded


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_f32_file_is_the_source_model(tmp_path, hf_models, bpe, name):
    path, model = _source(hf_models, bpe, name)
    loaded = checkpoint.load(write_family(tmp_path, hf_models, bpe, name, Q.F32))
    # The metadata describes the model config.json does (token ids come from the
    # vocabulary, eps through float32).
    expected = dataclasses.replace(
        ModelConfig.from_dir(path), rms_norm_eps=loaded.cfg.rms_norm_eps,
        bos_token_id=loaded.cfg.bos_token_id, eos_token_ids=loaded.cfg.eos_token_ids)
    assert loaded.cfg == expected
    assert loaded.cfg.rms_norm_eps == pytest.approx(model.config.rms_norm_eps)
    prompt = _prompt(loaded.cfg.vocab_size)
    tokens = forward_greedy(loaded.cfg, loaded.params, prompt, NUM_NEW)
    assert tokens == hf_greedy(model, prompt, NUM_NEW)


# Q8_0 of gemma2 and qwen3moe repeat gemma3's and Mixtral's paths (kept Gemma
# projections; kept experts without a shared one): the `matrix` marker's.
@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.matrix] if name in ("gemma2_gguf", "qwen3_moe") else [])
    for name in FAMILIES])
def test_q8_0_file_keeps_projections_and_experts_quantized(tmp_path, hf_models, bpe, name,
                                                           caplog):
    _, model = _source(hf_models, bpe, name)
    gguf_path = write_family(tmp_path, hf_models, bpe, name, Q.Q8_0)
    with caplog.at_level(logging.WARNING, logger="jaxpd.models.checkpoint"):
        loaded = checkpoint.load(gguf_path, quantization="auto")
    assert loaded.quantization == "gguf"
    layer = loaded.params["layers_0"]
    assert is_quantized(layer["q_proj"]) and layer["q_proj"].fmt == "q8_0"
    if loaded.cfg.is_moe:
        experts = [layer[n] for n in ("experts_gate", "experts_up", "experts_down")]
        assert all(is_quantized(w) and w.fmt == "q8_0" for w in experts)
        assert not is_quantized(layer["router"])
    if loaded.cfg.shared_expert_intermediate_size:
        # Shared experts are served as float, and the log says so.
        assert "_shexp.weight" in caplog.text and "dequantized to float" in caplog.text
        assert "_exps.weight" not in caplog.text
    else:
        assert "dequantized to float" not in caplog.text
    prompt = _prompt(loaded.cfg.vocab_size)
    tokens = forward_greedy(loaded.cfg, loaded.params, prompt, NUM_NEW)
    assert tokens == hf_greedy(_rounded_through(model, Q.Q8_0), prompt, NUM_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_1, pytest.param(Q.Q4_0, marks=pytest.mark.matrix)],
                         ids=lambda q: q.name)
def test_kept_experts_give_the_float_paths_tokens(tmp_path, hf_models, bpe, qtype):
    """qwen3moe's eight experts kept in 4-bit blocks against the same file read as
    float: the 21-token prompt runs the grouped matmuls, a 4-token one (8 pairs, no
    more than the experts) gathers each pair's blocks as a decode step does. Logits
    agree up to summation order and the greedy token after every prefix is the same."""
    path = write_family(tmp_path, hf_models, bpe, "qwen3_moe", qtype)
    kept = checkpoint.load(path, quantization="auto")
    flat = checkpoint.load(path, quantization="none")
    gate = kept.params["layers_1"]["experts_gate"]
    assert is_quantized(gate) and gate.fmt == qtype.name.lower()
    np.testing.assert_array_equal(np.asarray(dequantize(gate)),
                                  np.asarray(flat.params["layers_1"]["experts_gate"]))
    run = jax.jit(lambda p, x: Llama(kept.cfg).apply({"params": p}, x, method=Llama.forward))
    prompt = _prompt(kept.cfg.vocab_size)
    for tokens in (prompt, prompt[:4]):
        ours, theirs = (np.asarray(run(m.params, jnp.asarray([tokens]))[0]) for m in (kept, flat))
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
        assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()


@pytest.mark.slow
def test_k_quant_experts_stay_quantized(tmp_path, hf_models, bpe, caplog):
    """A qwen3moe file whose stacked experts are Q4_K (gate) and Q6_K (up) -- random
    super-blocks: `gguf` cannot write K-quants -- and whose q projection is Q4_K: with
    quantization="auto" the experts and the projection stay quantized, each
    dequantizing to exactly what `gguf`'s own dequantizer gives (the file read with
    quantization="none"), and logits agree up to summation order."""
    path, model = hf_models("qwen3_moe", vocab_size=len(bpe[0]), hidden_size=256, num_layers=1)
    cfg = model.config
    tensors = converter_tensors(path, cfg, "qwen3moe")
    rng = np.random.default_rng(0)
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    raw, q_rows = {}, tensors["blk.0.attn_q.weight"].shape[0]
    for name, qtype, rows in (("blk.0.ffn_gate_exps.weight", Q.Q4_K, e * f),
                              ("blk.0.ffn_up_exps.weight", Q.Q6_K, e * f),
                              ("blk.0.attn_q.weight", Q.Q4_K, q_rows)):
        del tensors[name]
        blocks = random_k_blocks(rows, d, qtype, rng)
        raw[name] = (blocks.reshape(e, f, -1) if "exps" in name else blocks, qtype)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    file = write_gguf(os.path.join(tmp_path, "k.gguf"), tensors, Q.Q8_0, arch="qwen3moe",
                      vocab=bpe, block_count=1, hidden=d, ffn=cfg.intermediate_size,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                      head_dim=cfg.head_dim, rope_theta=rope["rope_theta"],
                      eps=cfg.rms_norm_eps, extra=converter_metadata(cfg, "qwen3moe"), raw=raw)
    with caplog.at_level(logging.WARNING):
        kept = checkpoint.load(file, quantization="auto")
    assert "attn_q" not in caplog.text
    flat = checkpoint.load(file, quantization="none")
    layer = kept.params["layers_0"]
    assert [layer[n].fmt for n in ("q_proj", "experts_gate", "experts_up", "experts_down")] == [
        "q4_k", "q4_k", "q6_k", "q8_0"]
    for name in ("q_proj", "experts_gate", "experts_up"):
        np.testing.assert_array_equal(np.asarray(dequantize(layer[name])),
                                      np.asarray(flat.params["layers_0"][name]))
    run = jax.jit(lambda p, x: Llama(kept.cfg).apply({"params": p}, x, method=Llama.forward))
    prompt = jnp.asarray([_prompt(kept.cfg.vocab_size)])
    ours, theirs = (np.asarray(run(m.params, prompt)[0]) for m in (kept, flat))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()


# Serving these families is the default run's in `tests/test_families.py` (from
# safetensors); serving a GGUF file of them end to end -- kept Q8_0 projections and
# experts, the experts split over the decode mesh (and over the colocated one, which
# prefills with them kept too) -- is the `matrix` marker's.
@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("name,mesh", [("qwen2_moe_gguf", "prefill=2,decode=2x2"),
                                       ("qwen3_moe", "colocated=4"),
                                       ("gemma3_gguf", "prefill=2,decode=2")])
def test_llm_serves_a_q8_0_file(tmp_path, hf_models, bpe, name, mesh, monkeypatch):
    """At the library's defaults but for the sizes: warm-up, kept executables, no
    program compiled by a request."""
    from jaxpd import LLM, SamplingParams
    from tests.engine_fixtures import XlaCompiles, assert_all_pages_free

    _, model = _source(hf_models, bpe, name)
    path = write_family(tmp_path, hf_models, bpe, name, Q.Q8_0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, len(bpe[0]), size=n).tolist() for n in (1, 9, PROMPT_LEN)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
    with LLM(path, mesh=mesh, max_model_len=64, slots_per_shard=2) as llm, \
            XlaCompiles(on_request_threads=True) as xla:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
        assert_all_pages_free(llm)
        assert xla.count == 0
    reference = _rounded_through(model, Q.Q8_0)
    assert [list(o.token_ids) for o in outs] == [hf_greedy(reference, p, 6) for p in prompts]


# ---- what llama.cpp derives from the metadata -----------------------------------------

def test_gemma_layers_scale_and_softcaps_follow_llama_cpp(tmp_path, hf_models, bpe):
    """Without the optional keys: gemma2 softcaps at 50 and 30, its window is 4096;
    gemma3's period comes from `sliding_window_pattern` where present (a period or
    per-layer flags), and without a window it has no local layer; a 27B-sized layer
    count scales scores by (hidden / heads) ** -0.5."""
    plain = write_family(tmp_path, hf_models, bpe, "gemma2_gguf", Q.F32, extra={
        "gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None,
        "gemma2.attention.sliding_window": None})
    cfg, _ = source.model_config_and_tokenizer(plain)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.sliding_window) == (50.0, 30.0, 4096)
    assert cfg.sliding_layers == (True, False) and cfg.attn_scale == 16 ** -0.5

    def gemma3(extra):
        cfg, _ = source.model_config_and_tokenizer(
            write_family(tmp_path, hf_models, bpe, "gemma3_gguf", Q.F32, extra=extra))
        return cfg

    assert gemma3({}).sliding_layers == (True,) * 5 + (False,)
    assert gemma3({"gemma3.attention.sliding_window_pattern": 3}).sliding_layers == \
        (True, True, False) * 2
    flags = [False, True, True, False, True, True]
    assert gemma3({"gemma3.attention.sliding_window_pattern": flags}).sliding_layers == \
        tuple(flags)
    none = gemma3({"gemma3.attention.sliding_window": 0})
    assert none.sliding_layers == () and none.sliding_window is None
    assert gemma3({}).rope_local_theta == 10000.0 and gemma3({}).rope_linear_factor == 4.0


def test_gemma3_27b_layer_count_scales_by_hidden_over_heads(tmp_path, bpe):
    d, heads, layers = 32, 4, 62
    tensors = {"token_embd.weight": np.zeros((len(bpe[0]), d)),
               "output_norm.weight": np.ones(d)}
    path = write_gguf(str(tmp_path / "g.gguf"), tensors, Q.F32, arch="gemma3", vocab=bpe,
                      block_count=layers, hidden=d, ffn=64, heads=heads, kv_heads=2,
                      head_dim=16, extra={"gemma3.attention.sliding_window": 8})
    cfg, _ = source.model_config_and_tokenizer(path)
    assert cfg.attn_scale == (d // heads) ** -0.5 != cfg.head_dim ** -0.5
    assert sum(cfg.sliding_layers) == layers - layers // 6


# ---- refusals -------------------------------------------------------------------------

def test_an_expert_tensor_of_the_wrong_byte_count_is_refused(tmp_path, hf_models, bpe):
    """Kept experts are read block by block: a stacked expert tensor whose bytes do not
    fill its [E, F', D] rows of Q8_0 blocks (or whose rows are not the metadata's
    width) is refused naming it, before any expert is built."""
    from jaxpd.models import gguf as reader

    path = write_family(tmp_path, hf_models, bpe, "mixtral", Q.Q8_0)
    name = "blk.1.ffn_up_exps.weight"
    for cut in (lambda a: a.reshape(-1)[:-34], lambda a: a.reshape(-1)[:-1]):
        f = reader.GGUFFile(path)
        f.tensors[name] = f.tensors[name]._replace(data=cut(f.tensors[name].data))
        with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up_exps\.weight' \(Q8_0, "
                                             r"\d+ x 64\) holds \d+ bytes, expected"):
            list(reader.weights(f, reader.model_config(f), keep_quantized=True))
    f = reader.GGUFFile(path)
    cfg = reader.model_config(f)
    wide = dataclasses.replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size + 32)
    with pytest.raises(ValueError, match=rf"'blk\.0\.ffn_down_exps\.weight' has rows of "
                                         rf"{cfg.moe_intermediate_size} elements, expected "
                                         rf"{wide.moe_intermediate_size}"):
        list(reader.weights(f, wide, keep_quantized=True))


def test_qwen2moe_file_with_a_dense_layer_is_refused(tmp_path, hf_models, bpe):
    """llama.cpp's converter cannot write a Qwen MoE layer without experts
    (mlp_only_layers), and its loader has none: refused naming the layer's router."""
    d, f = 64, 128
    dense = {"blk.1.ffn_gate.weight": np.zeros((f, d)), "blk.1.ffn_up.weight": np.zeros((f, d)),
             "blk.1.ffn_down.weight": np.zeros((d, f))}
    dense.update({f"blk.1.{t}.weight": None for t in (
        "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp",
        "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")})
    path = write_family(tmp_path, hf_models, bpe, "qwen2_moe_gguf", Q.F32, tensors=dense)
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate_inp\.weight'.*layer 1 is a "
                                         r"dense MLP.*mlp_only_layers"):
        source.model_config_and_tokenizer(path)


@pytest.mark.parametrize("extra,match", [
    ({"qwen3moe.expert_weights_norm": False}, r"qwen3moe\.expert_weights_norm=False"),
    ({"qwen3moe.expert_gating_func": 2}, r"qwen3moe\.expert_gating_func=2"),
    ({"qwen3moe.expert_shared_count": 1}, r"qwen3moe\.expert_shared_count=1"),
    ({"qwen3moe.rope.scaling.type": "yarn"}, r"rope\.scaling\.type='yarn'"),
], ids=["no-renormalise", "sigmoid-gating", "shared-expert", "yarn"])
def test_routing_llama_cpp_would_run_differently_is_refused(tmp_path, hf_models, bpe,
                                                             extra, match):
    path = write_family(tmp_path, hf_models, bpe, "qwen3_moe", Q.F32, extra=extra)
    with pytest.raises(ValueError, match=match):
        source.model_config_and_tokenizer(path)


def test_expert_count_disagreeing_with_the_tensors_is_refused(tmp_path, hf_models, bpe):
    path = write_family(tmp_path, hf_models, bpe, "mixtral", Q.F32,
                        extra={"llama.expert_count": 3})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_inp\.weight' \(weight "
                                         r"layers_0/router\) has shape \(64, 4\).*\(64, 3\)"):
        checkpoint.load(path)


def test_experts_in_an_architecture_without_them_are_refused(tmp_path, hf_models, bpe):
    path = write_family(tmp_path, hf_models, bpe, "gemma2_gguf", Q.F32,
                        extra={"gemma2.expert_count": 4})
    with pytest.raises(ValueError, match=r"gemma2\.expert_count=4.*not supported for gemma2"):
        source.model_config_and_tokenizer(path)
