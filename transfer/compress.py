"""Optional KV-page compression for the transfer: int8 or fp8 (e4m3) with per-page scales.

Pages are [L, P, S, K, H]; one float32 scale per (layer, page) keeps a loud page from
flattening a quiet one while costing 4 bytes per S*K*H values. Quantise on the prefill
side before `send`, dequantise on the decode side after `place`: lossy, so it trades
exactness (greedy output may change) for 4x (float32) or 2x (bfloat16) fewer bytes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

Kind = Literal["int8", "fp8"]

# Largest finite magnitude of each code; values are scaled so the page's amax maps to it.
_CODE_MAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}  # fp8: 448
_CODE_DTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class CompressedPages:
    """values: [L, P, S, K, H] int8 or float8_e4m3fn; scales_LP: [L, P] float32."""
    values: jax.Array
    scales_LP: jax.Array
    dtype: str

    @property
    def num_bytes(self) -> int:
        """Bytes to move: codes plus scales."""
        return int(self.values.nbytes) + int(self.scales_LP.nbytes)

    @property
    def original_num_bytes(self) -> int:
        return int(self.values.size) * jnp.dtype(self.dtype).itemsize


@functools.partial(jax.jit, static_argnames="kind")
def _quantize(pages_LPSKH: jax.Array, kind: Kind) -> tuple[jax.Array, jax.Array]:
    x = pages_LPSKH.astype(jnp.float32)
    amax_LP = jnp.max(jnp.abs(x), axis=(2, 3, 4))
    # An all-zero page gets scale 1 so that it divides cleanly and stays zero.
    scales_LP = jnp.where(amax_LP > 0, amax_LP / _CODE_MAX[kind], 1.0)
    scaled = x / scales_LP[:, :, None, None, None]
    if kind == "int8":
        scaled = jnp.round(scaled)
    scaled = jnp.clip(scaled, -_CODE_MAX[kind], _CODE_MAX[kind])
    return scaled.astype(_CODE_DTYPE[kind]), scales_LP


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize(values: jax.Array, scales_LP: jax.Array, dtype: str) -> jax.Array:
    return (values.astype(jnp.float32) * scales_LP[:, :, None, None, None]).astype(dtype)


def quantize_pages(pages_LPSKH: jax.Array, kind: Kind) -> CompressedPages:
    """int8 (round to nearest) or fp8 e4m3 codes with one scale per (layer, page)."""
    if kind not in _CODE_MAX:
        raise ValueError(f"kind must be 'int8' or 'fp8', got {kind!r}")
    if pages_LPSKH.ndim != 5:
        raise ValueError(f"pages must be [L, P, S, K, H], got shape {pages_LPSKH.shape}")
    values, scales_LP = _quantize(pages_LPSKH, kind)
    return CompressedPages(values, scales_LP, jnp.dtype(pages_LPSKH.dtype).name)


def dequantize_pages(pages: CompressedPages) -> jax.Array:
    """The pages back in their original dtype. Lossy: int8 is off by at most half a
    step (page amax / 254); fp8 e4m3 by 2**-4 of the value (3 mantissa bits), or half
    its smallest subnormal step near zero."""
    return _dequantize(pages.values, pages.scales_LP, pages.dtype)
