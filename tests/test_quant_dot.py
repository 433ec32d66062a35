"""The native product of quantized weights with int8 activations (`quant.native_dot`,
`models/native/quant_dot.cc`): each body (AVX-512 VNNI where this CPU has it, AVX2, the
portable one) computes exactly the integer arithmetic of `quant.dot_reference`, and a
model served through it keeps the float path's greedy tokens.

Tolerances. Against `dot_reference` only the order of float sums differs: 1e-5 of the
largest output. That is far below what one element of x rounded to the other side
would move an output (a step of x times a weight: 1e-4 of the largest output or more
here), so the integer part, x's rounding included, must match exactly. Against the
float product x's rounding costs up to half a step of each block (1/254 of its largest
element): the tiny model's logits stay within LOGIT_ATOL of the float path's (their
spread over the vocabulary is about 7), and a greedy token may differ only where the
float path's two best logits are closer than that.
"""
import ctypes

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models import checkpoint, native_attention, quant
from tests.model_helpers import paged_greedy
from tests.support.gguf_files import gguf_tensors, train_bpe, write_gguf
from tests.support.quant_blocks import kernel_call, random_weight

Q = gguf.GGMLQuantizationType
FORMATS = ["int8", "q8_0", "q4_0", "q4_1"]
# Rows of x: one, a partial register tile, a whole panel tile pair, a panel tile and one.
ROWS = (1, 3, 16, 33)


def _needs_native():
    if not native_attention.quant_available():
        pytest.skip(native_attention.quant_unavailable_reason())


def _body(flags: tuple[str, ...], name: str, sources=None):
    """The int8 product of a library built with `flags` (another body of the kernel),
    registered as `name`; `sources`: only these kernels."""
    build = native_attention._build(flags) if sources is None else \
        native_attention._build(flags, sources)
    library = ctypes.cdll.LoadLibrary(str(build))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(library.JaxpdQuantDot), platform="cpu")
    return kernel_call(name)


def _check_against_reference(product, fmt: str):
    rng = np.random.default_rng(0)
    # 42 rows of W: whole tiles and two over, a panel of 16 and a partial one; 96
    # columns: three blocks, so a pair of blocks and one alone.
    w = random_weight(fmt, 42, 96, rng)
    for m in ROWS:
        x = rng.normal(size=(m, 96)).astype(np.float32)
        x[0, :32] = 0.0                     # a block of zeros: scale 0, no division
        x[-1, 32:64] *= 1e3                 # a loud block beside quiet ones
        if m > 1:                           # ties, rounded to nearest even
            x[1, 64:96] = 0.0
            x[1, 64:68] = [127.0, 2.5, 3.5, -0.5]
        want = quant.dot_reference(x, w)
        got = np.asarray(jax.jit(product)(jnp.asarray(x), w))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        # x's rounding is visible at this tolerance: the float product differs by more.
        float_product = np.asarray(x, np.float64) @ np.asarray(quant.dequantize_rows(w), np.float64).T
        assert np.abs(float_product - want).max() > 10 * 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_built_body_computes_the_integer_reference(fmt):
    _needs_native()
    _check_against_reference(kernel_call(native_attention.QUANT_DOT_TARGET), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_body_computes_the_integer_reference(fmt):
    """The body an AVX2 CPU runs (built here without AVX-512: the library the float
    product's portable test builds too)."""
    _needs_native()
    if "avx2" not in native_attention._cpu_identity().split():
        pytest.skip("no AVX2 here")
    _check_against_reference(_body(("-mno-avx512f",), "jaxpd_quant_dot_avx2"), fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_portable_body_computes_the_integer_reference(fmt):
    _needs_native()
    """The body of a CPU without AVX2 (and of other architectures), built alone."""
    source = next(f for f in native_attention._SOURCES if f.name == "quant_dot.cc")
    _check_against_reference(_body(("-mno-avx2", "-mno-avx512f"), "jaxpd_quant_dot_portable",
                                   (source,)), fmt)


def test_quantized_activations_follow_llama_cpp_rounding():
    """Blocks of 32, d = max|x| / 127, nearest even (2.5 -> 2, 3.5 -> 4), zeros stay."""
    x = np.zeros((2, 64), np.float32)
    x[0, :4] = [127.0, 2.5, 3.5, -127.0]
    x[1, 32:34] = [1.0, -0.5]
    q, d = quant.quantize_activations(x)
    assert q[0, :4].tolist() == [127, 2, 4, -127] and d[0].tolist() == [1.0, 0.0]
    assert q[1, 32:34].tolist() == [127, -64] and d[1, 1] == np.float32(1 / 127)
    assert not q[0, 32:].any() and not q[1, :32].any()


def test_native_dot_keeps_native_matmul_signature():
    """Any rows (a prompt's too), a stacked run's layer read in place, None for
    another dtype."""
    _needs_native()
    rng = np.random.default_rng(1)
    w, other = random_weight("q4_1", 8, 64, rng), random_weight("q4_1", 8, 64, rng)
    x = rng.normal(size=(quant.NATIVE_MAX_ROWS + 5, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(quant.native_dot(jnp.asarray(x), w)),
                               quant.dot_reference(x, w), atol=1e-4)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), w, other)
    got = jax.jit(lambda x, s, j: quant.native_dot(x, s, layer=j))(jnp.asarray(x[:2]), stacked, 1)
    np.testing.assert_allclose(np.asarray(got), quant.dot_reference(x[:2], other), atol=1e-4)
    assert quant.native_dot(jnp.asarray(x, jnp.bfloat16), w) is None


PROMPTS = ["Hello world, hello", "The quick brown fox", "Prefill and decode run on"]
NUM_NEW = 24


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _write(tmp_path, hf, bpe, qtype) -> str:
    cfg = hf.config
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    return write_gguf(str(tmp_path / f"{qtype.name}.gguf"), gguf_tensors(state, cfg, "llama"),
                      qtype, arch="llama", vocab=bpe, block_count=cfg.num_hidden_layers,
                      hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                      eps=cfg.rms_norm_eps)


# A near-tie: the float path's two best logits closer than the logits' tolerance.
LOGIT_ATOL = 0.25


def _near_tie_or_same(ours: list[int], want: list[int], logits: np.ndarray, what: str):
    """`ours` is `want`, or first differs at a token whose float logits (`logits[j]`
    chose token j + 1) had their two best within LOGIT_ATOL."""
    i = _first_divergence(ours, want)
    if i is not None:
        top2 = np.sort(logits[i - 1])[-2:]
        assert i > 0 and top2[1] - top2[0] < LOGIT_ATOL, (what, i, top2)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [
    Q.Q4_1, pytest.param(Q.Q8_0, marks=pytest.mark.matrix),
    pytest.param(Q.Q4_0, marks=pytest.mark.matrix)])
def test_int8_activations_keep_greedy_tokens_of_a_tiny_gguf(tmp_path, hf_models, bpe, qtype):
    """The dequantized float path's greedy tokens, or a first difference at a near-tie,
    and logits within LOGIT_ATOL (the tiny model's spread over its vocabulary is about
    7) up to there: through the model (prefill of 16 rows: the panel; decode of 2 rows:
    the register tiles) and through an engine on `prefill=1,decode=1` with
    `quant_activations="int8"`, whose prefill mesh keeps the blocks and runs its prompts
    through `native_dot`, as its decode steps do."""
    from jaxpd import LLM, SamplingParams

    _needs_native()
    path = _write(tmp_path, hf_models("llama_gqa", vocab_size=len(bpe[0]))[1], bpe, qtype)
    kept, flat = (checkpoint.load(path, quantization=q) for q in ("auto", "none"))
    want = {}
    for text in PROMPTS:
        prompt = kept.tokenizer.encode(text)
        want[text] = paged_greedy(flat.cfg, flat.params, prompt, NUM_NEW)
        ours, our_logits = paged_greedy(kept.cfg, kept.params, prompt, NUM_NEW,
                                        qmatmul=quant.native_dot)
        i = _first_divergence(ours, want[text][0])
        same = NUM_NEW - 1 if i is None else i        # steps that saw equal prefixes
        np.testing.assert_allclose(our_logits[:same], want[text][1][:same], atol=LOGIT_ATOL)
        _near_tie_or_same(ours, *want[text], text)
    if qtype != Q.Q4_1:
        return
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    # Few programs: short context, few slots and batch sizes, no prefix-cache programs.
    with LLM(model=path, mesh="prefill=1,decode=1", max_model_len=64, slots_per_shard=4,
             max_prefill_batch=4, enable_prefix_caching=False,
             quant_activations="int8", warmup=False) as llm:
        outs = llm.generate(PROMPTS, params)
        prefill, decode = llm.engine.prefill_runner, llm.engine.decode_runner
        assert decode.quant_matmul is quant.native_dot
        assert prefill.quant_matmul is quant.native_dot and quant.any_quantized(prefill.params)
    for text, out in zip(PROMPTS, outs):
        _near_tie_or_same(list(out.token_ids), *want[text], f"engine: {text}")


def test_quant_activations_default_to_float_and_are_checked():
    """"float" by default, "int8" accepted (also as the launcher's flag), anything else
    refused naming the field."""
    from absl import flags

    from jaxpd.config import EngineConfig
    from jaxpd.serving import launch_flags

    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", "--quant_activations", "int8"])
    assert launch_flags.engine_options(fv)["quant_activations"] == "int8"

    assert EngineConfig(mesh="prefill=1,decode=1").quant_activations == "float"
    assert EngineConfig(mesh="prefill=1,decode=1", quant_activations="int8").quant_activations == "int8"
    with pytest.raises(ValueError, match="quant_activations must be one of"):
        EngineConfig(mesh="prefill=1,decode=1", quant_activations="int4")
