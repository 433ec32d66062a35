"""Opt-in compressed transfer: KV pages travel as int8 or fp8 (e4m3) codes with one
float32 scale per (layer, page), restored on arrival. Lossy: it trades exactness
(greedy output may change in rare near-ties) for 4x (float32) or 2x (bfloat16) fewer
bytes.

Any connector carries it unchanged: codes and scales are packed into one byte array
per K and V, `[L, P, S*K*H + 4]` uint8 (the last 4 bytes of each page row are its
scale), so pages stay the unit of transfer and only used pages move. One scale per
page keeps a loud page from flattening a quiet one, at 4 bytes per S*K*H values.
`CompressingSender` packs before `send`; `CompressingReceiver` unpacks after `place`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpd.transfer.connector import KVHandoff, KVReceiver, KVSender

Kind = Literal["int8", "fp8"]

# Largest finite magnitude of each code; values are scaled so the page's amax maps to it.
_CODE_MAX = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}  # fp8: 448
_CODE_DTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _check_kind(kind: str) -> None:
    if kind not in _CODE_MAX:
        raise ValueError(f"kv_transfer_dtype must be 'int8' or 'fp8', got {kind!r}")


def pack_pages(pages_LPSKH: jax.Array, kind: Kind) -> jax.Array:
    """[L, P, S, K, H] pages -> [L, P, S*K*H + 4] uint8: int8 (round to nearest) or fp8
    e4m3 codes, then the page's float32 scale. An all-zero page gets scale 1."""
    _check_kind(kind)
    if pages_LPSKH.ndim != 5:
        raise ValueError(f"pages must be [L, P, S, K, H], got shape {pages_LPSKH.shape}")
    return _pack(pages_LPSKH, kind)


def unpack_pages(packed: jax.Array, kind: Kind, page_shape: tuple[int, int, int],
                 dtype: str) -> jax.Array:
    """The pages back as [L, P, S, K, H] `dtype`. Lossy: int8 is off by at most half a
    step (page amax / 254); fp8 e4m3 by 2**-4 of the value (3 mantissa bits), or half
    its smallest subnormal step near zero."""
    _check_kind(kind)
    return _unpack(packed, kind, tuple(page_shape), jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnames="kind")
def _pack(pages_LPSKH, kind: Kind):
    x = pages_LPSKH.astype(jnp.float32)
    amax_LP = jnp.max(jnp.abs(x), axis=(2, 3, 4))
    scales_LP = jnp.where(amax_LP > 0, amax_LP / _CODE_MAX[kind], 1.0)
    scaled = x / scales_LP[:, :, None, None, None]
    if kind == "int8":
        scaled = jnp.round(scaled)
    values = jnp.clip(scaled, -_CODE_MAX[kind], _CODE_MAX[kind]).astype(_CODE_DTYPE[kind])
    l, p = values.shape[:2]
    codes = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(l, p, -1)
    scales = jax.lax.bitcast_convert_type(scales_LP, jnp.uint8)           # [L, P, 4]
    return jnp.concatenate([codes, scales], axis=-1)


@functools.partial(jax.jit, static_argnames=("kind", "page_shape", "dtype"))
def _unpack(packed, kind: Kind, page_shape: tuple[int, int, int], dtype: str):
    l, p = packed.shape[:2]
    codes = jax.lax.bitcast_convert_type(packed[..., :-4], _CODE_DTYPE[kind])
    scales_LP = jax.lax.bitcast_convert_type(packed[..., -4:], jnp.float32)
    values = codes.reshape(l, p, *page_shape).astype(jnp.float32)
    return (values * scales_LP[:, :, None, None, None]).astype(dtype)


class CompressingSender:
    """Wraps a sender: each handoff's pages leave packed."""

    def __init__(self, inner: KVSender, kind: Kind):
        _check_kind(kind)
        self.inner, self.kind = inner, kind

    def send(self, handoff: KVHandoff) -> None:
        self.inner.send(dataclasses.replace(handoff, k=_pack(handoff.k, self.kind),
                                            v=_pack(handoff.v, self.kind)))

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def wait_pulled(self, timeout: float) -> int:
        wait = getattr(self.inner, "wait_pulled", None)
        return 0 if wait is None else wait(timeout)

    def close(self) -> None:
        self.inner.close()


class CompressingReceiver:
    """Wraps a receiver; `page_shape` (S, K, H) and `dtype` are the pool's."""

    def __init__(self, inner: KVReceiver, kind: Kind, page_shape: tuple[int, int, int],
                 dtype: str):
        _check_kind(kind)
        self.inner, self.kind = inner, kind
        self.page_shape, self.dtype = tuple(page_shape), jnp.dtype(dtype).name

    def receive(self, timeout: float | None) -> KVHandoff | None:
        return self.inner.receive(timeout)

    def place(self, handoff: KVHandoff, sharding: jax.sharding.Sharding):
        # Move the bytes onto the shard's devices as they are, then decode there.
        packed = NamedSharding(sharding.mesh, P())
        k, v, stats = self.inner.place(handoff, packed)
        k, v = (jax.device_put(_unpack(x, self.kind, self.page_shape, self.dtype), sharding)
                for x in (k, v))
        return k, v, stats

    def discard(self, handoff: KVHandoff) -> None:
        self.inner.discard(handoff)

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def close(self) -> None:
        self.inner.close()
