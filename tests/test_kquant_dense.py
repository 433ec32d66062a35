"""Dense Q4_K and Q6_K weights kept quantized (`models.kquant`, `models.quant`): a tiny
llama whose every projection, embedding and output head is a K-quant, in Q4_K_M's
mixture (Q4_K for most, Q6_K for the output head and, in one layer, attn_v and
ffn_down, so a run of layers holds mixed formats), loads kept with
quantization="auto", each weight dequantizing to exactly what `gguf`'s own dequantizer
gives (quantization="none"), and runs to the float path's logits and greedy tokens,
through the native product where it is built; a short K-quant tensor is refused naming
it.

The blocks are random (`gguf` cannot write K-quants): small float16 super-block scales,
so logits stay of order one. Kept and float hold the same values, so logits differ only
by summation order (atol 1e-4).
"""
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models import checkpoint, gguf as gguf_reader, kquant, quant
from jaxpd.models.llama import Llama
from tests.model_helpers import paged_greedy
from tests.support.gguf_files import random_k_blocks, train_bpe, write_gguf
from tests.support.quant_blocks import greedy_kept_and_float

Q = gguf.GGMLQuantizationType
D, F, N, K, LAYERS = 256, 512, 4, 2, 3
MIXED_LAYER = 1                       # its attn_v and ffn_down are Q6_K, the others' Q4_K
PROMPTS = ["Hello world, hello", "The quick brown fox", "Prefill and decode run on"]
NUM_NEW = 16


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


def _kinds(vocab: int) -> dict[str, tuple[tuple[int, int], object]]:
    """GGUF tensor -> (numpy shape [rows, cols], K-quant type)."""
    kinds = {"token_embd.weight": ((vocab, D), Q.Q4_K), "output.weight": ((vocab, D), Q.Q6_K)}
    for i in range(LAYERS):
        mixed = Q.Q6_K if i == MIXED_LAYER else Q.Q4_K
        kinds.update({f"blk.{i}.attn_q.weight": ((D, D), Q.Q4_K),
                      f"blk.{i}.attn_k.weight": ((D * K // N, D), Q.Q4_K),
                      f"blk.{i}.attn_v.weight": ((D * K // N, D), mixed),
                      f"blk.{i}.attn_output.weight": ((D, D), Q.Q4_K),
                      f"blk.{i}.ffn_gate.weight": ((F, D), Q.Q4_K),
                      f"blk.{i}.ffn_up.weight": ((F, D), Q.Q4_K),
                      f"blk.{i}.ffn_down.weight": ((D, F), mixed)})
    return kinds


def write_k_model(path: str, bpe, short: int = 0) -> str:
    """The tiny K-quant llama; `short`: bytes cut from the end of the last tensor
    written (`output.weight`), as a truncated download would."""
    rng = np.random.default_rng(0)
    kinds = _kinds(len(bpe[0]))
    raw = {name: (random_k_blocks(*shape, qtype, rng), qtype)
           for name, (shape, qtype) in kinds.items() if name != "output.weight"}
    shape, qtype = kinds["output.weight"]
    raw["output.weight"] = (random_k_blocks(*shape, qtype, rng), qtype)   # written last
    norms = {"output_norm.weight": np.full(D, 4.0)}
    for i in range(LAYERS):
        norms.update({f"blk.{i}.attn_norm.weight": rng.uniform(0.5, 1.5, D),
                      f"blk.{i}.ffn_norm.weight": rng.uniform(0.5, 1.5, D)})
    write_gguf(path, norms, Q.F32, arch="llama", vocab=bpe, block_count=LAYERS, hidden=D,
               ffn=F, heads=N, kv_heads=K, raw=raw)
    if short:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - short)
    return path


@pytest.fixture(scope="module")
def k_model(tmp_path_factory, bpe):
    return write_k_model(str(tmp_path_factory.mktemp("k") / "k.gguf"), bpe)


@pytest.fixture(scope="module")
def loaded(k_model):
    return {q: checkpoint.load(k_model, quantization=q) for q in ("auto", "none")}


def _forward(cfg, params, tokens):
    run = jax.jit(lambda p, t: Llama(cfg).apply({"params": p}, t, method=Llama.forward))
    return np.asarray(run(params, jnp.asarray([tokens]))[0])


def test_dense_k_quants_stay_quantized_holding_the_float_values(loaded):
    kept, flat = loaded["auto"], loaded["none"]
    assert kept.quantization == "gguf" and flat.quantization == "none"
    names = {v: k for k, v in gguf_reader.tensor_names(kept.cfg).items()}
    for name, (_, qtype) in _kinds(kept.cfg.vocab_size).items():
        path = names[name]
        w = kept.params
        want = flat.params
        for key in path:
            w, want = w[key], want[key]
        assert quant.is_quantized(w) and w.fmt == kquant.K_FORMATS[qtype.name][0], name
        np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), np.asarray(want),
                                      err_msg=name)
    counts = dict(part.split(" x") for part in quant.describe(kept.params).split(", "))
    assert counts == {"q4_k": str(LAYERS * 7 + 1 - 2), "q6_k": "3",
                      "float": str(2 * LAYERS + 1)}
    # A decode step reads the stored blocks: q4_k 24 and q6_k 40 bytes per 32 weights.
    assert quant.step_bytes(kept.params, False) < quant.step_bytes(flat.params, False) / 4


@pytest.mark.slow
def test_dense_k_quants_give_the_float_path_logits_and_tokens(loaded):
    """The jnp form in a full forward; prefill and paged decode through the native
    product where it is built (a decode step's one row: its few-rows form)."""
    kept, flat = loaded["auto"], loaded["none"]
    native = quant.native_matmul if quant.native_available() else None
    for text in PROMPTS:
        prompt = kept.tokenizer.encode(text)
        np.testing.assert_allclose(_forward(kept.cfg, kept.params, prompt),
                                   _forward(flat.cfg, flat.params, prompt), atol=1e-4)
        ours, ours_logits = paged_greedy(kept.cfg, kept.params, prompt, NUM_NEW, qmatmul=native)
        want, want_logits = paged_greedy(flat.cfg, flat.params, prompt, NUM_NEW)
        np.testing.assert_allclose(ours_logits, want_logits, atol=1e-4)
        assert ours == want


def test_a_short_k_quant_tensor_is_refused_naming_it(tmp_path, bpe):
    """A K-quant tensor's bytes are checked against its shape before they are read; a
    file cut inside its last tensor is refused by the reader already, as corrupt."""
    path = write_k_model(str(tmp_path / "short.gguf"), bpe, short=7)
    with pytest.raises(ValueError, match="short.gguf: cannot be read.*corrupt or truncated"):
        checkpoint.load(path, quantization="auto")
    rows, cols = 4, 512
    for qtype, size in (("Q4_K", 144), ("Q6_K", 210)):
        good = np.zeros(rows * cols // 256 * size, np.uint8)
        fmt, data, _, _ = kquant.from_gguf_k_rows(good, qtype, rows, cols, "w")
        assert data.shape[0] == rows
        for raw in (good[:-1], np.zeros(good.size + size, np.uint8)):
            with pytest.raises(ValueError, match=rf"'blk.0.ffn_down.weight' \({qtype}.*expected"):
                kquant.from_gguf_k_rows(raw, qtype, rows, cols, "blk.0.ffn_down.weight")


@pytest.mark.slow
def test_dense_k_quants_shard_like_their_float_weights(loaded):
    """On a tp mesh (a prefill mesh's, where the jnp form runs): output channels split
    over tp, scales and mins with them; the same logits as unsharded."""
    import flax.linen as nn
    from jax.sharding import Mesh
    from jaxpd.engine.programs.placement import place_params

    kept = loaded["auto"]
    prompt = kept.tokenizer.encode(PROMPTS[1])
    want = _forward(kept.cfg, kept.params, prompt)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "tp"))
    for fuse in (False, True):
        params, rules, fused = place_params(kept.cfg, kept.params, mesh, jnp.float32, fuse=fuse)
        layer = params["layers_0"]
        gate = layer["gate_up_proj" if fused else "gate_proj"]
        assert gate.fmt == "q4_k" and gate.data.sharding.spec[0] == "tp"
        assert gate.min.sharding.spec[0] == "tp"
        down = params[f"layers_{MIXED_LAYER}"]["down_proj"]
        assert down.fmt == "q6_k" and down.scale.sharding.spec[-1] == "tp"
        with mesh, nn.logical_axis_rules(rules):
            got = jax.jit(lambda p, t: Llama(kept.cfg, fused=fused).apply(
                {"params": p}, t, method=Llama.forward))(params, jnp.asarray([prompt]))[0]
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


@pytest.mark.slow
def test_llm_serves_dense_k_quants_as_the_float_path_does(k_model):
    """Through the engine on `prefill=1,decode=1`: twelve prompts at once, so decode
    steps take the native product at one row and at 9 to 16 (its panel form), and the
    decode mesh scans none of the run of mixed layers; the same greedy tokens as the
    file read as float."""
    def check(llm):
        runner = llm.engine.decode_runner
        assert quant.any_quantized(runner.params)
        assert (runner.quant_matmul is not None) == quant.native_available()

    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    outs = greedy_kept_and_float(k_model, prompts, NUM_NEW, check)
    assert outs["auto"] == outs["none"]
