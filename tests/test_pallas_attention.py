"""The Pallas decode attention kernels, interpreted on CPU, against the `jnp` reference;
the `attention_impl` choice; and one engine run with the GPU kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig, resolve_attention_impl
from jaxpd.models.attention import paged_attention
from jaxpd.models.pallas_attention import (decode_attention, paged_attention_gpu,
                                           paged_attention_tpu)


def _case(seed, *, b=4, kh=2, g=2, h=16, page_size=4, max_pages=5, num_pages=9,
          dtype=jnp.float32):
    """Random pools and block tables that share pages, point at the null page 0, and
    lengths from 1 to the table's full width."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, kh * g, h))
    k = rng.standard_normal((num_pages, page_size, kh, h))
    v = rng.standard_normal((num_pages, page_size, kh, h))
    tables = rng.integers(0, num_pages, (b, max_pages))
    tables[0] = tables[1]                                # two slots share every page
    tables[2, max_pages // 2:] = 0                        # a tail of null pages
    lengths = rng.integers(1, max_pages * page_size + 1, b)
    lengths[0], lengths[1] = 1, max_pages * page_size
    lengths[2] = min(lengths[2], (max_pages // 2) * page_size) or 1
    arrays = [jnp.asarray(x, dtype) for x in (q, k, v)]
    return (*arrays, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _bf16_kv(q, k, v, tables, lengths):
    """The TPU kernel computes with K and V cast to bfloat16; so does this reference."""
    cast = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    return q, cast(k), cast(v), tables, lengths


# The fast tier keeps one case of the GPU kernel; CI runs them all.
_slow = pytest.mark.slow


@pytest.mark.parametrize("g,page_size", [(2, 4), pytest.param(1, 1, marks=_slow),
                                         pytest.param(4, 16, marks=_slow),
                                         pytest.param(1, 16, marks=_slow)])
def test_gpu_kernel_matches_reference(g, page_size):
    args = _case(g * 100 + page_size, g=g, page_size=page_size,
                 max_pages=max(3, 24 // page_size))
    out = paged_attention_gpu(*args, interpret=True)
    np.testing.assert_allclose(out, paged_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pages_per_block", [1, 8])
def test_gpu_kernel_any_pages_per_block(pages_per_block):
    # 5 pages per slot: blocks of 2, 4 and 8 run past the table (padded with page 0).
    args = _case(7, kh=1, g=4, page_size=4, max_pages=5)
    out = paged_attention_gpu(*args, pages_per_block=pages_per_block, interpret=True)
    np.testing.assert_allclose(out, paged_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gpu_kernel_bfloat16_and_jit():
    args = _case(3, g=4, dtype=jnp.bfloat16)
    out = jax.jit(decode_attention("pallas_gpu", interpret=True))(*args)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(paged_attention(*args), np.float32), atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("g,page_size", [(1, 4), (4, 8)])
def test_tpu_kernel_matches_reference(g, page_size):
    args = _case(g * 10 + page_size, g=g, page_size=page_size, max_pages=max(3, 24 // page_size))
    out = paged_attention_tpu(*args, pages_per_block=2, interpret=True)
    np.testing.assert_allclose(out, paged_attention(*_bf16_kv(*args)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, paged_attention(*args), atol=3e-2)


# The shapes the engine serves: head dims 64 and 128, GQA ratios 1, 4 and 8, page sizes
# 16, 32 and 64, ragged lengths (1 token, a full table, a tail of null pages, shared
# pages) over a table as wide as a decode context width. Each value appears with each
# other dimension at least once; the fast tier keeps one case of each kernel.
_ENGINE_SHAPES = [(128, 4, 16), (64, 1, 16), (64, 8, 32), (128, 1, 32), (64, 4, 64),
                  (128, 8, 64)]


def _engine_params(fast):
    return [pytest.param(*shape, marks=() if shape == fast else _slow) for shape in _ENGINE_SHAPES]


def _engine_case(h, g, page_size, dtype=jnp.float32):
    return _case(h + 10 * g + page_size, b=4, kh=2, g=g, h=h, page_size=page_size,
                 max_pages=8, num_pages=17, dtype=dtype)


@pytest.mark.parametrize("h,g,page_size", _engine_params(fast=(128, 4, 16)))
def test_gpu_kernel_at_engine_shapes(h, g, page_size):
    args = _engine_case(h, g, page_size)
    out = paged_attention_gpu(*args, interpret=True)
    np.testing.assert_allclose(out, paged_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,g,page_size", _engine_params(fast=(128, 4, 16)))
def test_tpu_kernel_at_engine_shapes(h, g, page_size):
    args = _engine_case(h, g, page_size)
    out = paged_attention_tpu(*args, interpret=True)
    np.testing.assert_allclose(out, paged_attention(*_bf16_kv(*args)), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_in_bfloat16_at_an_engine_shape(impl):
    """The TPU and GPU serving dtype, at the TPU kernel's head dim."""
    args = _engine_case(128, 4, 16, dtype=jnp.bfloat16)
    out = jax.jit(decode_attention(impl, interpret=True))(*args)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(paged_attention(*args), np.float32), atol=2e-2)


@pytest.mark.parametrize("impl,platform,expected", [
    ("auto", "gpu", "reference"), ("auto", "cuda", "reference"),
    ("auto", "tpu", "reference"), ("reference", "tpu", "reference"),
    ("pallas_gpu", "gpu", "pallas_gpu"), ("pallas_tpu", "tpu", "pallas_tpu")])
def test_attention_impl_resolves_by_platform(impl, platform, expected):
    assert resolve_attention_impl(impl, platform) == expected


@pytest.mark.parametrize("platform,dtype,head_dim,expected", [
    ("tpu", "bfloat16", 128, "pallas_tpu"), ("tpu", "bfloat16", 256, "pallas_tpu"),
    ("tpu", "bfloat16", 64, "reference"),     # Mosaic tiles the head dim by 128 lanes
    ("tpu", "float32", 128, "reference"),     # the kernel would compute K, V in bfloat16
    ("cuda", "bfloat16", 128, "reference"), ("gpu", "float32", 64, "reference")])
def test_auto_picks_the_tpu_kernel_where_it_lowers(platform, dtype, head_dim, expected):
    assert resolve_attention_impl("auto", platform, dtype=dtype, head_dim=head_dim) == expected


def test_the_tpu_kernel_is_refused_for_a_head_dim_it_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 128.*is 64"):
        resolve_attention_impl("pallas_tpu", "tpu", dtype="bfloat16", head_dim=64)
    assert resolve_attention_impl("pallas_tpu", "cpu", interpret=True, head_dim=64) == \
        "pallas_tpu"


def test_attention_impl_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="attention_impl='pallas_tpu' cannot run on cpu"):
        resolve_attention_impl("pallas_tpu", "cpu")
    with pytest.raises(ValueError, match="attention_impl='pallas_gpu' cannot run on tpu"):
        resolve_attention_impl("pallas_gpu", "tpu")
    assert resolve_attention_impl("pallas_tpu", "cpu", interpret=True) == "pallas_tpu"
    with pytest.raises(ValueError, match="attention_interpret=True needs a Pallas"):
        resolve_attention_impl("auto", "cpu", interpret=True)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        resolve_attention_impl("flash", "gpu")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        EngineConfig(mesh="colocated=1", attention_impl="triton")
    with pytest.raises(ValueError, match="attention_interpret=True needs a Pallas"):
        decode_attention("reference", interpret=True)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _generate(path, mesh, impl, prompts, max_tokens):
    with LLM(path, mesh=mesh, max_model_len=64, slots_per_shard=4, attention_impl=impl,
             attention_interpret=impl != "reference", warmup=False) as llm:
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=[_greedy(max_tokens)] * len(prompts))
    return [o.token_ids for o in outs]


def _prompts(lengths):
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,impl", [("prefill=1,decode=1x2", "pallas_gpu")])
def test_engine_with_kernel_matches_hf(hf_models, mesh, impl):
    # decode=1x2 splits the 2 kv heads over tp: the kernel runs per tp shard.
    from tests.hf_fixtures import hf_greedy

    path, hf_model = hf_models("llama_gqa")
    prompts = _prompts((1, 5, 17, 33))
    assert _generate(path, mesh, impl, prompts, 8) == [hf_greedy(hf_model, p, 8)
                                                       for p in prompts]
