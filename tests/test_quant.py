"""Weights kept quantized (`models.quant`): GGUF block formats served as stored give the
model the dequantized float path gives; int8 made at load from a float checkpoint stays
close to float; bad files are refused naming the tensor; quantized weights shard as
their float weights do.

Tolerances: a kept GGUF weight holds exactly the values the float path dequantizes, so
logits differ only by summation order (atol 1e-4). int8 rounds every weight: the
built-in model's logits stay within 0.25 (its logits' spread is about 2.5), and int8
picks float's greedy token after at least 95% of the prefixes of float's 64-token
continuations.
"""
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models import checkpoint
from jaxpd.models import gguf as gguf_reader, quant
from jaxpd.models.layout import fuse_params, quantize_params
from jaxpd.models.llama import Llama
from tests.model_helpers import paged_greedy
from tests.support.gguf_files import gguf_tensors, train_bpe, write_gguf
from tests.support.quant_blocks import (greedy_kept_and_float, kernel_call, random_blocks,
                                       random_weight)

Q = gguf.GGMLQuantizationType
PROMPTS = ["Hello world, hello", "The quick brown fox", "Prefill and decode run on"]
NUM_NEW = 24


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


@pytest.fixture(scope="module")
def hf_llama(hf_models, bpe):
    return hf_models("llama_gqa", vocab_size=len(bpe[0]))[1]


def write(tmp_path, hf_model, qtype, vocab, raw=None) -> str:
    cfg = hf_model.config
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    tensors = gguf_tensors(state, cfg, "llama")
    for name in raw or {}:
        tensors.pop(name)
    return write_gguf(str(tmp_path / f"{qtype.name}.gguf"), tensors, qtype, arch="llama",
                      vocab=vocab, block_count=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                      ffn=cfg.intermediate_size, heads=cfg.num_attention_heads,
                      kv_heads=cfg.num_key_value_heads, eps=cfg.rms_norm_eps, raw=raw)


def forward(cfg, params, tokens, fused=False):
    return np.asarray(Llama(cfg, fused=fused).apply({"params": params}, jnp.asarray([tokens]),
                                                    method=Llama.forward)[0])


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0])
def test_kept_gguf_blocks_match_the_dequantized_float_path(tmp_path, hf_llama, bpe, qtype):
    path = write(tmp_path, hf_llama, qtype, bpe)
    kept = checkpoint.load(path, quantization="auto")
    flat = checkpoint.load(path, quantization="none")
    assert kept.quantization == "gguf" and flat.quantization == "none"
    q = kept.params["layers_0"]["q_proj"]
    assert quant.is_quantized(q) and q.fmt == quant.GGUF_FORMATS[qtype.name]
    assert quant.weight_bytes(kept.params) < quant.weight_bytes(flat.params) / 2
    # Every weight holds what the float path reads.
    np.testing.assert_array_equal(np.asarray(quant.dequantize(q)),
                                  np.asarray(flat.params["layers_0"]["q_proj"]))
    for text in PROMPTS:
        prompt = kept.tokenizer.encode(text)
        ours = forward(kept.cfg, kept.params, prompt)
        np.testing.assert_allclose(ours, forward(flat.cfg, flat.params, prompt), atol=1e-4)
        np.testing.assert_allclose(
            forward(kept.cfg, fuse_params(kept.cfg, kept.params), prompt, fused=True), ours,
            atol=1e-4)
        tokens, _ = paged_greedy(kept.cfg, kept.params, prompt, NUM_NEW)
        assert tokens == paged_greedy(flat.cfg, flat.params, prompt, NUM_NEW)[0]


@pytest.mark.slow
def test_kept_q4_1_logits_match_the_float_path(tmp_path, hf_llama, bpe):
    path = write(tmp_path, hf_llama, Q.Q4_1, bpe)
    kept, flat = (checkpoint.load(path, quantization=q) for q in ("auto", "none"))
    prompt = kept.tokenizer.encode(PROMPTS[0])
    np.testing.assert_allclose(forward(kept.cfg, kept.params, prompt),
                               forward(flat.cfg, flat.params, prompt), atol=1e-4)


@pytest.mark.slow
def test_int8_agrees_with_float_on_the_built_in_model():
    from jaxpd.default_model import default_model_dir

    flat = checkpoint.load(default_model_dir())
    int8 = checkpoint.load(default_model_dir(), quantization="int8")
    assert int8.quantization == "int8"
    assert quant.weight_bytes(int8.params) < quant.weight_bytes(flat.params) / 3
    same = total = 0
    for text in ["Once upon a time", "The weather today is", "In the beginning there was"]:
        prompt = flat.tokenizer.encode(text)
        np.testing.assert_allclose(forward(int8.cfg, int8.params, prompt),
                                   forward(flat.cfg, flat.params, prompt), atol=0.25)
        cont, _ = paged_greedy(flat.cfg, flat.params, prompt, 64)
        # Teacher-forced: int8's greedy choice after each prefix of float's continuation.
        logits = forward(int8.cfg, int8.params, prompt + cont[:-1])[len(prompt) - 1:]
        same += int(np.sum(np.argmax(logits, -1) == np.asarray(cont)))
        total += len(cont)
    assert same / total >= 0.95, (same, total)


def test_int8_scales_follow_their_output_channels():
    w = np.random.default_rng(0).normal(size=(8, 4, 6)).astype(np.float32)   # [D, N, H]
    w[:, 1, 2] *= 100.0          # one output channel much larger than the rest
    q = quant.quantize_int8(w, (0,))
    assert q.data.shape == (4, 6, 8) and q.scale.shape == (4, 6, 1)
    back = np.asarray(quant.dequantize(q))
    assert back.shape == w.shape
    err = np.abs(back - w).max(axis=0)
    # Each channel's error is at most half its own step, not the loud channel's.
    np.testing.assert_array_less(err, np.abs(w).max(axis=0) / 127 * 0.5 + 1e-6)
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quant.project(jnp.asarray(x), q, "BD,DNH->BNH")),
                               np.einsum("BD,DNH->BNH", x, back), rtol=1e-5, atol=1e-4)


def _portable_product():
    """The kernel's portable body, built without AVX-512 under its own target name, or
    None where this CPU has no AVX-512 (the default build is then that body already)."""
    import ctypes
    from jaxpd.models import native_attention

    if "avx512f" not in native_attention._cpu_identity().split():
        return None
    library = ctypes.cdll.LoadLibrary(str(native_attention._build(("-mno-avx512f",))))
    jax.ffi.register_ffi_target("jaxpd_quant_matmul_portable",
                                jax.ffi.pycapsule(library.JaxpdQuantMatmul), platform="cpu")
    return kernel_call("jaxpd_quant_matmul_portable")


@pytest.mark.parametrize("body", ["built", "portable"])
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_native_product_matches_the_jnp_form(fmt, body):
    """Both bodies of the kernel (AVX-512 where this CPU has it, and the portable one),
    against the jnp form on the same weight: the dequantized values are the same
    floats, so only summation order differs (rtol 1e-5, atol 1e-4 on sums of 96
    products of order 1). Rows of x: one, a partial register tile, whole tiles, a
    tile and one, and a prefill's many; 42 rows of W: whole tiles of 4 and two over."""
    from jaxpd.models import native_attention
    if not native_attention.quant_available():
        pytest.skip(native_attention.quant_unavailable_reason())
    product = kernel_call(native_attention.QUANT_MATMUL_TARGET)
    if body == "portable":
        product = _portable_product()
        if product is None:
            pytest.skip("no AVX-512 here: the built body is the portable one")
    rng = np.random.default_rng(0)
    rows, cols = 42, 96
    w = (quant.quantize_int8(rng.normal(size=(cols, rows)).astype(np.float32), (0,))
         if fmt == "int8" else random_blocks(fmt, rows, cols, rng))
    for m in (1, 3, 16, 33, 128):
        x = jnp.asarray(rng.normal(size=(m, cols)).astype(np.float32))
        got = jax.jit(product)(x, w)
        want = np.asarray(quant.matmul(x, w))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(quant.matmul(x, w)),
                               np.asarray(x) @ np.asarray(quant.dequantize_rows(w)).T,
                               rtol=1e-5, atol=1e-4)
    x = jnp.asarray(rng.normal(size=(2, cols)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(quant.native_matmul(x, w)),
                               np.asarray(quant.matmul(x, w)), rtol=1e-5, atol=1e-4)
    big = jnp.zeros((quant.NATIVE_MAX_ROWS + 1, cols), jnp.float32)
    assert quant.native_matmul(big, w) is None       # a prefill's rows: the jnp form
    if fmt in ("q4_k", "q6_k"):   # int8 activations: the K-quants take this kernel, x as is
        for m in (2, 100):
            xm = jnp.asarray(rng.normal(size=(m, cols)).astype(np.float32))
            np.testing.assert_allclose(np.asarray(jax.jit(quant.native_dot)(xm, w)),
                                       np.asarray(quant.matmul(xm, w)), rtol=1e-5, atol=1e-4)
    if body == "built":     # a scanned run's stack: the layer named, read in place
        other = (quant.quantize_int8(rng.normal(size=(cols, rows)).astype(np.float32), (0,))
                 if fmt == "int8" else random_blocks(fmt, rows, cols, rng))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), w, other, w)
        got = jax.jit(lambda x, s, j: quant.native_matmul(x, s, layer=j))(x, stacked, 1)
        want = np.asarray(x) @ np.asarray(quant.dequantize_rows(other)).T
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_native_product_panels_match_the_jnp_form(fmt):
    """The AVX-512 body's panel form (nine rows of x or more) at the edges of its
    blocking: a contraction of 1,600 (50 blocks: three slices of 17, 17 and 16 blocks),
    13 rows of W (a panel of 8 and one of 5, whose last tile of 4 has one real row),
    rows of x at the threshold, whole and partial tiles of 6, and 300 rows (x in two
    blocks for L2). Sums of 1,600 products: within 1e-5 of the largest output."""
    from jaxpd.models import native_attention
    if not native_attention.quant_available():
        pytest.skip(native_attention.quant_unavailable_reason())
    product = jax.jit(kernel_call(native_attention.QUANT_MATMUL_TARGET))
    rng = np.random.default_rng(1)
    rows, cols = 13, 1600
    w = random_weight(fmt, rows, cols, rng)
    for m in (8, 9, 12, 17, 300):
        x = jnp.asarray(rng.normal(size=(m, cols)).astype(np.float32))
        want = np.asarray(x, np.float64) @ np.asarray(quant.dequantize_rows(w), np.float64).T
        if fmt == "int8":   # the jnp form's order: the row scale after the sum
            q = np.asarray(w.data, np.float64)
            want = (np.asarray(x, np.float64) @ q.T) * np.asarray(w.scale, np.float64).T
        got = np.asarray(product(x, w))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_unsupported_block_format_names_the_tensor_and_auto_serves_it_as_float(
        tmp_path, hf_llama, bpe, caplog):
    path = write(tmp_path, hf_llama, Q.Q5_1, bpe)
    f = gguf_reader.GGUFFile(path)
    with pytest.raises(ValueError, match=r"token_embd.weight.*Q5_1.*quantization='none'"):
        list(gguf_reader.weights(f, gguf_reader.model_config(f), keep_quantized=True))
    with caplog.at_level("WARNING"):
        assert checkpoint.load(path, quantization="auto").quantization == "none"
    assert "'token_embd.weight' is Q5_1" in caplog.text
    assert checkpoint.load(path, quantization="none").quantization == "none"


def test_q5_0_is_kept_as_q8_0_holding_what_gguf_dequantizes():
    """Q5_0 re-read as q8_0 (q - 16 as int8, the float16 scale as stored): every value
    what `gguf`'s dequantizer gives, bit for bit, the high bits of every element
    position exercised."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 96)).astype(np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)            # q spans 0 .. 31 in one block
    raw = gguf.quants.quantize(x, Q.Q5_0)
    data, scale, low = quant.from_gguf_rows(raw.reshape(-1), "q5_0", 5, 96, "w")
    assert data.dtype == np.int8 and low is None and data.min() == -16 and data.max() == 15
    w = quant.QuantizedWeight(data, scale, None, quant.GGUF_FORMATS["Q5_0"], (96, 5), (0,))
    np.testing.assert_array_equal(np.asarray(quant.dequantize_rows(w)),
                                  gguf.quants.dequantize(raw, Q.Q5_0))
    with pytest.raises(ValueError, match="'w' \\(Q5_0, 5 x 96\\) holds"):
        quant.from_gguf_rows(raw.reshape(-1)[:-1], "q5_0", 5, 96, "w")


def test_a_block_of_the_wrong_byte_count_is_refused():
    rows, cols = 4, 64
    good = np.zeros(rows * cols // 32 * 20, np.uint8)
    data, scale, low = quant.from_gguf_rows(good, "q4_1", rows, cols, "w")
    assert data.shape == (4, 32) and scale.shape == low.shape == (4, 2)
    for raw in (good[:-1], np.zeros(good.size + 20, np.uint8)):
        with pytest.raises(ValueError, match="'blk.0.attn_q.weight'.*bytes, expected"):
            quant.from_gguf_rows(raw, "q4_1", rows, cols, "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="not whole Q4_1 blocks"):
        quant.from_gguf_rows(good, "q4_1", rows, 48, "w")


def test_a_truncated_file_is_refused_at_load(tmp_path, hf_llama, bpe):
    path = write(tmp_path, hf_llama, Q.Q4_1, bpe)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(ValueError):
        checkpoint.load(path, quantization="auto")


def test_unknown_quantization_is_refused():
    from jaxpd.default_model import default_model_dir
    with pytest.raises(ValueError, match="quantization must be one of"):
        checkpoint.load(default_model_dir(), quantization="int4")


@pytest.mark.slow
def test_quantized_weights_shard_like_their_float_weights(tmp_path, hf_llama, bpe):
    from jax.sharding import Mesh
    from jaxpd.engine.programs.placement import place_params

    path = write(tmp_path, hf_llama, Q.Q4_1, bpe)
    kept = checkpoint.load(path, quantization="auto")
    prompt = kept.tokenizer.encode(PROMPTS[1])
    want = forward(kept.cfg, kept.params, prompt)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "tp"))
    for fuse in (False, True):
        params, rules, fused = place_params(kept.cfg, kept.params, mesh, jnp.float32, fuse=fuse)
        q = params["layers_0"]["qkv_proj" if fused else "q_proj"]
        # Output channels (heads / kv heads) split over tp, scales with them.
        assert q.data.sharding.spec[0] == "tp" and q.scale.sharding.spec[0] == "tp"
        import flax.linen as nn
        with mesh, nn.logical_axis_rules(rules):
            got = jax.jit(lambda p, t: Llama(kept.cfg, fused=fused).apply(
                {"params": p}, t, method=Llama.forward))(params, jnp.asarray([prompt]))[0]
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


@pytest.mark.slow
def test_int8_from_float_params_fuses_and_projects():
    from jaxpd.models.config import ModelConfig
    from jaxpd.models.layout import init_params

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      attention_bias=False, tie_word_embeddings=False)
    q = quantize_params(init_params(cfg))
    tokens = list(range(1, 9))
    np.testing.assert_allclose(forward(cfg, fuse_params(cfg, q), tokens, fused=True),
                               forward(cfg, q, tokens), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["colocated=1", "prefill=2,decode=2"])
def test_llm_serves_kept_blocks_as_the_float_path_does(tmp_path, hf_llama, bpe, mesh):
    """Through the engine: decode steps take the native product on CPU (prefill the jnp
    form; with tp on the prefill mesh, weights split over it), same greedy tokens as
    the file read as float."""
    from jaxpd import LLM, SamplingParams
    from jaxpd.models import native_attention

    path = write(tmp_path, hf_llama, Q.Q4_1, bpe)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outs = {}
    for quantization in ("none", "auto"):
        with LLM(model=path, mesh=mesh, quantization=quantization, warmup=False) as llm:
            outs[quantization] = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
            runner = llm.engine.decode_runner
            if quantization == "auto":
                assert quant.any_quantized(runner.params)
                assert (runner.quant_matmul is not None) == native_attention.quant_available()
                if runner.quant_matmul is not None:   # its cost grows with every row
                    assert llm.engine.decode_loop.batch_sizes[0] == 1
    assert outs["auto"] == outs["none"]


@pytest.mark.slow
def test_a_full_decode_batch_of_kept_blocks_matches_the_float_path(tmp_path, hf_llama, bpe):
    """Twelve prompts at once on `prefill=1,decode=1`: decode steps of 9 to 16 rows take
    the native product's panel form, with the same greedy tokens as the file read as
    float."""
    path = write(tmp_path, hf_llama, Q.Q4_1, bpe)
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    outs = greedy_kept_and_float(path, prompts, NUM_NEW)
    assert outs["auto"] == outs["none"]


def test_bench_compares_llama_cpp_after_the_meshes():
    from jaxpd.bench.args import backends_of, parse_compare
    from jaxpd.bench.cli import parse_args

    assert parse_compare("colocated=2,llama_cpp,hf") == ["colocated=2", "llama_cpp", "hf"]
    args = parse_args(["--mesh", "colocated=1", "--compare", "llama_cpp,hf",
                       "--quantization", "auto", "--single_stream", "2"])
    assert backends_of(args) == ["colocated=1", "hf", "llama_cpp"]
    assert args.quantization == "auto" and args.single_stream == 2
    with pytest.raises(ValueError, match="llama_cpp"):
        parse_compare("llama.cpp")


def test_roofline_counts_stored_weight_bytes():
    from jaxpd.bench.roofline import decode_cost
    from jaxpd.models.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64)
    flops, floats = decode_cost(cfg, 1, 16)
    _, stored = decode_cost(cfg, 1, 16, weight_bytes=1000)
    assert floats - stored == cfg.num_params * 4 - 1000


def test_decode_steps_of_the_native_product_start_at_one_row():
    from jaxpd.engine.scheduling.buckets import decode_batch_sizes
    assert decode_batch_sizes(32) == [8, 16, 32]
    assert decode_batch_sizes(32, from_one=True) == [1, 2, 4, 8, 16, 32]


def test_quantization_flag_reaches_the_engine_config():
    from absl import flags

    from jaxpd.config import EngineConfig
    from jaxpd.serving import launch_flags

    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", "--quantization", "auto"])
    options = launch_flags.engine_options(fv)
    assert options["quantization"] == "auto"
    assert EngineConfig(mesh="colocated=1", quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(mesh="colocated=1", quantization="q4")
