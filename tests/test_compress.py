"""int8 / fp8 KV-page compression: error bounds per page, bytes saved, zero pages.

The packed form is what crosses the wire: per page, its codes then its float32 scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.transfer.compression import pack_pages, unpack_pages

L, NUM_PAGES, S, K, H = 2, 3, 16, 4, 8


def pages(dtype=jnp.float32) -> jax.Array:
    """Pages whose magnitudes differ by 1000x, so a shared scale would crush the small ones;
    the last page is all zeros."""
    x = jax.random.normal(jax.random.key(0), (L, NUM_PAGES, S, K, H))
    x = x * (10.0 ** jnp.arange(-1, 2, dtype=jnp.float32))[None, :, None, None, None]
    return x.at[1, 2].set(0.0).astype(dtype)


def roundtrip(x, kind):
    return unpack_pages(pack_pages(x, kind), kind, (S, K, H), x.dtype)


def scales_of(packed) -> np.ndarray:
    """The [L, P] float32 scales stored in the last 4 bytes of each packed page."""
    return np.ascontiguousarray(np.asarray(packed)[..., -4:]).view(np.float32)[..., 0]


def page_amax(x) -> np.ndarray:
    return np.max(np.abs(np.asarray(x, np.float32)), axis=(2, 3, 4), keepdims=True)


@pytest.mark.slow
def test_int8_error_is_within_half_a_step_of_each_page():
    x = pages()
    y = roundtrip(x, "int8")
    err = np.abs(np.asarray(y) - np.asarray(x))
    assert np.all(err <= page_amax(x) / 254 * (1 + 1e-5))


@pytest.mark.slow
def test_fp8_error_is_within_its_mantissa_precision():
    x = pages()
    packed = pack_pages(x, "fp8")
    codes = np.asarray(packed)[..., :-4].view(jnp.float8_e4m3fn)   # one fp8 code per value
    assert codes.shape == (L, NUM_PAGES, S * K * H)
    np.testing.assert_array_equal(codes.astype(np.float32).reshape(x.shape) * scales_of(packed)[
        :, :, None, None, None], np.asarray(unpack_pages(packed, "fp8", (S, K, H), x.dtype)))
    y = np.asarray(roundtrip(x, "fp8"))
    scale = page_amax(x) / 448
    # 3 mantissa bits: half an ulp is 2**-4 of the value; below the normal range the
    # step is scale * 2**-9.
    bound = np.abs(np.asarray(x)) * 2.0 ** -4 + scale * 2.0 ** -10
    assert np.all(np.abs(y - np.asarray(x)) <= bound * (1 + 1e-5))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_bytes_before_and_after_and_zero_pages(kind):
    for dtype, itemsize in ((jnp.float32, 4), (jnp.bfloat16, 2)):
        x = pages(dtype)
        packed = pack_pages(x, kind)
        assert x.nbytes == x.size * itemsize
        assert packed.nbytes == x.size + L * NUM_PAGES * 4
        assert scales_of(packed).shape == (L, NUM_PAGES)
        y = unpack_pages(packed, kind, (S, K, H), dtype)
        assert y.dtype == dtype and y.shape == x.shape
        assert float(scales_of(packed)[1, 2]) == 1.0
        assert not np.any(np.asarray(y[1, 2], np.float32))


def test_sharded_pages_keep_their_values():
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("tp",)), P(None, None, None, "tp"))
    x = jax.device_put(pages(), sharding)
    y = roundtrip(x, "int8")
    np.testing.assert_allclose(np.asarray(y), np.asarray(pages()), atol=float(page_amax(x).max()) / 254)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kv_transfer_dtype"):
        pack_pages(pages(), "int4")
    with pytest.raises(ValueError, match=r"\[L, P, S, K, H\]"):
        pack_pages(jnp.zeros((4, 4)), "int8")
