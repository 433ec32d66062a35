"""Opt-in compressed transfer: a `Connector` wrapper that ships KV pages as int8 or
fp8 (e4m3) codes with one scale per (layer, page), restored on arrival.

Any connector can carry it, unchanged: codes and scales are packed into one byte array
per K and V, `[L, P, S*K*H + 4]` uint8 (the last 4 bytes of each page row are its
float32 scale), so pages stay the unit of transfer and only used pages move. Lossy:
greedy output may differ from uncompressed in rare near-ties (measured in tests).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from transfer.compress import Kind, _dequantize, _quantize
from transfer.connector import Connector, KVHandoff


@functools.partial(jax.jit, static_argnames="kind")
def _pack(pages_LPSKH, kind: Kind):
    values, scales_LP = _quantize(pages_LPSKH, kind)
    l, p = values.shape[:2]
    codes = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(l, p, -1)
    scales = jax.lax.bitcast_convert_type(scales_LP, jnp.uint8)           # [L, P, 4]
    return jnp.concatenate([codes, scales], axis=-1)


@functools.partial(jax.jit, static_argnames=("kind", "page_shape", "dtype"))
def _unpack(packed, kind: Kind, page_shape: tuple[int, int, int], dtype: str):
    l, p = packed.shape[:2]
    code_dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    codes = jax.lax.bitcast_convert_type(packed[..., :-4], code_dtype).reshape(l, p, *page_shape)
    scales_LP = jax.lax.bitcast_convert_type(packed[..., -4:], jnp.float32)
    return _dequantize(codes, scales_LP, dtype)


class CompressingConnector:
    """Wraps `inner`; `page_shape` (S, K, H) and `dtype` are the pool's."""

    def __init__(self, inner: Connector, kind: Kind, page_shape: tuple[int, int, int], dtype: str):
        if kind not in ("int8", "fp8"):
            raise ValueError(f"kv_transfer_dtype must be 'int8' or 'fp8', got {kind!r}")
        self.inner, self.kind = inner, kind
        self.page_shape, self.dtype = tuple(page_shape), jnp.dtype(dtype).name

    def send(self, handoff: KVHandoff) -> None:
        self.inner.send(dataclasses.replace(handoff, k=_pack(handoff.k, self.kind),
                                            v=_pack(handoff.v, self.kind)))

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

    def close(self) -> None:
        self.inner.close()
