"""Weights kept quantized: one pytree (`QuantizedWeight`) and one product (`project`).

A quantized weight is stored *output channels first, contraction last*, in blocks along
the contraction, as GGUF stores a row:

  data   [*out, I']   int8 (`int8`, `q8_0`, `q6_k`) or uint8 nibble pairs (`q4_0`,
                      `q4_1`, `q4_k`)
  scale  [*out, nb]   one per block of `block` contraction elements
  min    [*out, nb]   `q4_1`, `q4_k` only (value = q * scale + min)

Formats: `int8` (weight-only, one block per output channel, float32 scale: quantized
at load from a float checkpoint), and GGUF's `q8_0` (value = q * d; GGUF's Q5_0 too,
re-read at load), `q4_0` ((q - 8) * d) and `q4_1` (q * d + m), blocks of 32 with
float16 scales as stored; `q4_k` (`q4_1`'s layout) and `q6_k` (int8, blocks of 16),
GGUF's K-quants re-read at load with float32 scales (`models.kquant`). A nibble pair
byte j of a block holds element j (low) and element j + 16 (high).

`float_shape` and `in_dims` say which float weight it stands for (the float layout of
`models.llama`, e.g. q_proj [D, N, H] contracting dim 0, o_proj [N, H, D] contracting
dims 0 and 1, the embedding [V, D] contracting dim 1), so the model's einsum strings
stay its documentation, sharding follows the float weight's logical axes
(`shardings_like`), and `dequantize` gives back the float weight.

`project(x, w, spec)` is the one product every projection goes through: an einsum for
a float weight; for a quantized one, x's trailing contraction dims against the blocks
(`matmul`): the portable jnp form (dequantize inside the jitted product), or a native
kernel the caller passes (`native_matmul`, CPU, few rows, every format; or
`native_dot`, CPU, x's rows quantized to int8 blocks and each block's product taken in
integers, the K-quants through `native_matmul`'s kernel).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

BLOCK = 32
# Formats and, per block of BLOCK elements, the bytes a decode step reads.
FORMATS = ("int8", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
_NIBBLES = ("q4_0", "q4_1", "q4_k")
# GGUF's block formats kept as stored, and the format each is kept in: Q5_0 (value =
# (q - 16) * d, q 5 bits) is re-read at load as q8_0, exactly (q - 16 fits int8).
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q8_0"}
_GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22}


@struct.dataclass
class QuantizedWeight:
    data: jnp.ndarray
    scale: jnp.ndarray
    min: jnp.ndarray | None
    fmt: str = struct.field(pytree_node=False)
    float_shape: tuple = struct.field(pytree_node=False)
    in_dims: tuple = struct.field(pytree_node=False)

    @property
    def out_shape(self) -> tuple:
        return tuple(self.data.shape[:-1])

    @property
    def in_size(self) -> int:
        return math.prod(self.float_shape[i] for i in self.in_dims)

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize
                   for a in (self.data, self.scale, self.min) if a is not None)

    def map_out(self, fn: Callable, float_shape: tuple) -> "QuantizedWeight":
        """The same weight with `fn` applied to the output dims of every part (each
        part's leading dims are the output channels), now standing for `float_shape`."""
        parts = [None if a is None else fn(a) for a in (self.data, self.scale, self.min)]
        return QuantizedWeight(*parts, fmt=self.fmt, float_shape=tuple(float_shape),
                               in_dims=self.in_dims)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def any_quantized(params) -> bool:
    return any(map(is_quantized, jax.tree.leaves(params, is_leaf=is_quantized)))


def _out_dims(float_shape, in_dims) -> list[int]:
    return [i for i in range(len(float_shape)) if i not in in_dims]


# --- making quantized weights -------------------------------------------------------

def quantize_int8(w, in_dims: tuple[int, ...]) -> QuantizedWeight:
    """Symmetric int8 with one float32 scale per output channel (max |w| / 127 over the
    contraction), from a float weight in the model's layout."""
    w = jnp.asarray(w, jnp.float32)
    out = _out_dims(w.shape, in_dims)
    rows = jnp.transpose(w, (*out, *in_dims)).reshape(*(w.shape[i] for i in out), -1)
    scale = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(rows / scale), -127, 127).astype(jnp.int8)
    return QuantizedWeight(q, scale, None, "int8", tuple(w.shape), tuple(in_dims))


def from_gguf_rows(raw: np.ndarray, fmt: str, rows: int, cols: int, name: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's raw bytes (`rows` rows of `cols` elements in `fmt` blocks, GGUF's
    type name in lower case) -> (data [rows, I'], scale [rows, nb] float16, min or None)
    in the format `GGUF_FORMATS` keeps it in. The byte count is checked against the
    shape before anything is read: a short or long tensor is refused."""
    if cols % BLOCK:
        raise ValueError(f"tensor {name!r}: rows of {cols} elements are not whole "
                         f"{fmt.upper()} blocks of {BLOCK}")
    nb, size = cols // BLOCK, _GGUF_BLOCK_BYTES[fmt]
    raw = np.asarray(raw)
    want = rows * nb * size
    if raw.dtype != np.uint8 or raw.size != want:
        raise ValueError(f"tensor {name!r} ({fmt.upper()}, {rows} x {cols}) holds "
                         f"{raw.size * raw.dtype.itemsize} bytes, expected {want}: the "
                         f"file is corrupt or truncated")
    blocks = raw.reshape(rows, nb, size)
    scale = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(rows, nb)
    if fmt == "q8_0":
        data = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
        return data, scale, None
    if fmt == "q4_0":
        return np.ascontiguousarray(blocks[:, :, 2:]).reshape(rows, nb * 16), scale, None
    if fmt == "q5_0":
        # Bytes 2-5: the 32 high bits (bit j of the little-endian word: element j's);
        # then nibbles as q4_0's (byte j: element j low, j + 16 high).
        high = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")             # [rows, nb, 1]
        bits = ((high >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
        low = blocks[:, :, 6:]
        q = np.concatenate([low & 0xF, low >> 4], axis=-1) | (bits << 4)
        return (q.astype(np.int16) - 16).astype(np.int8).reshape(rows, cols), scale, None
    low = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(rows, nb)
    return np.ascontiguousarray(blocks[:, :, 4:]).reshape(rows, nb * 16), scale, low


# --- reading them --------------------------------------------------------------------

def _unpack(w: QuantizedWeight, dtype) -> jnp.ndarray:
    """Elements as `dtype` [*out, nb, BLOCK] (before scale), in contraction order."""
    out = w.out_shape
    if w.fmt in _NIBBLES:
        b = w.data.reshape(*out, -1, BLOCK // 2)
        q = jnp.concatenate([b & 0xF, b >> 4], axis=-1).astype(dtype)
        return q - 8 if w.fmt == "q4_0" else q
    return w.data.reshape(*out, -1, w.data.shape[-1] // w.scale.shape[-1]).astype(dtype)


def dequantize_rows(w: QuantizedWeight, dtype=jnp.float32) -> jnp.ndarray:
    """[*out, I] in `dtype`: the weight with output channels first."""
    q = _unpack(w, dtype)
    v = q * w.scale[..., None].astype(dtype)
    if w.min is not None:
        v = v + w.min[..., None].astype(dtype)
    return v.reshape(*w.out_shape, -1)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jnp.ndarray:
    """The float weight it stands for, in the model's layout (`float_shape`)."""
    rows = dequantize_rows(w, dtype)
    out = _out_dims(w.float_shape, w.in_dims)
    rows = rows.reshape(*w.out_shape, *(w.float_shape[i] for i in w.in_dims))
    order = out + list(w.in_dims)
    return jnp.transpose(rows, np.argsort(order))


def take_rows(w: QuantizedWeight, ids, dtype) -> jnp.ndarray:
    """Rows `ids` of a weight whose output channels are one dim (the embedding's
    vocab), dequantized: [*ids.shape, I]."""
    part = QuantizedWeight(w.data[ids], w.scale[ids], None if w.min is None else w.min[ids],
                           w.fmt, w.float_shape, w.in_dims)
    q = _unpack(part, dtype)
    v = q * part.scale[..., None].astype(dtype)
    if part.min is not None:
        v = v + part.min[..., None].astype(dtype)
    return v.reshape(*ids.shape, -1)


def matmul(x: jnp.ndarray, w: QuantizedWeight) -> jnp.ndarray:
    """x [M, I] @ w -> [M, O] (O = the output channels flattened), the portable form:
    int8 converts its weight into x's dtype inside the product and scales each output
    after it; block formats dequantize inside the jitted product."""
    o = math.prod(w.out_shape)
    if w.fmt == "int8":
        q = w.data.reshape(o, -1).astype(x.dtype)
        y = jnp.einsum("MI,OI->MO", x, q, preferred_element_type=jnp.float32)
        return (y * w.scale.reshape(o)).astype(x.dtype)
    return jnp.einsum("MI,OI->MO", x, dequantize_rows(w, x.dtype).reshape(o, -1))


def project(x: jnp.ndarray, w, spec: str, native: Callable | None = None,
            preferred_element_type=None) -> jnp.ndarray:
    """`jnp.einsum(spec, x, w)` for a float weight. For a `QuantizedWeight` the spec's
    contraction must be x's trailing dims and the output x's other dims then the
    weight's output dims (true of every projection of `models.llama`); `native`
    (`native_matmul`'s result or None) may take the product instead of the jnp form."""
    if not is_quantized(w):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    n_in = len(w.in_dims)
    lead = x.shape[:x.ndim - n_in]
    x2 = x.reshape(math.prod(lead), -1)
    y = native(x2, w) if native is not None else None
    if y is None:
        y = matmul(x2, w)
    if preferred_element_type is not None:
        y = y.astype(preferred_element_type)
    return y.reshape(*lead, *w.out_shape)


# --- the native CPU product ---------------------------------------------------------

_FMT_CODES = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3, "q4_k": 4, "q6_k": 5}
# Formats `native/quant_dot.cc` takes; the K-quants' blocks of mixed scales are not
# among them, and `native_dot` takes those through the float product instead.
_DOT_FORMATS = ("int8", "q8_0", "q4_0", "q4_1")
# Rows of x up to which the native kernel takes the product (a decode step's, where it
# reads each weight once for all rows); a prefill's many rows go to XLA's dot on the
# dequantized weight, which the kernel's panel form (`native/quant_matmul.cc`) only
# matches there.
NATIVE_MAX_ROWS = 64


def native_available() -> bool:
    """Whether the native CPU product is built and registered here (a library of
    `models.native_attention`, built on first use)."""
    from jaxpd.models import native_attention
    return native_attention.quant_available()


def native_matmul(x: jnp.ndarray, w: QuantizedWeight, layer=None) -> jnp.ndarray | None:
    """x [M, I] float32 @ w -> [M, O] float32 through the native CPU kernel
    (`native/quant_matmul.cc`), or None where it does not serve (more than
    `NATIVE_MAX_ROWS` rows, another dtype or block format, the kernel not built): the
    caller then takes the jnp form. Opaque to GSPMD: pass it only where the weights are
    whole on each device (a decode mesh without tp). `layer`: w's parts stack a run of layers on a
    leading axis and the product uses this one (an int or a traced int32), read in
    place in the stack."""
    if x.shape[0] > NATIVE_MAX_ROWS:
        return None
    from jaxpd.models.native_attention import QUANT_MATMUL_TARGET
    return _native_call(QUANT_MATMUL_TARGET, x, w, layer)


def native_dot(x: jnp.ndarray, w: QuantizedWeight, layer=None) -> jnp.ndarray | None:
    """`native_matmul`'s contract, with x's rows quantized to int8 blocks of 32 (one
    scale each, as llama.cpp's Q8 activations) and each block's product with w's
    taken in integers (`native/quant_dot.cc`): x is rounded to 8 bits, so the result
    differs from the float product by that rounding (see `dot_reference`). Any number
    of rows. The K-quants (`q4_k`, `q6_k`) go through `native_matmul`'s kernel, x as
    it is, at any number of rows (its panel form)."""
    from jaxpd.models.native_attention import QUANT_DOT_TARGET, QUANT_MATMUL_TARGET
    target = QUANT_DOT_TARGET if w.fmt in _DOT_FORMATS else QUANT_MATMUL_TARGET
    return _native_call(target, x, w, layer)


def _native_call(target: str, x: jnp.ndarray, w: QuantizedWeight, layer) -> jnp.ndarray | None:
    if x.dtype != jnp.float32 or w.fmt not in _FMT_CODES or not native_available():
        return None
    lead = () if layer is None else w.data.shape[:1]
    o = math.prod(w.data.shape[len(lead):-1])
    low = w.min if w.min is not None else w.scale
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], o), jnp.float32))
    return call(x, *(a.reshape(*lead, o, -1) for a in (w.data, w.scale, low)),
                jnp.asarray(0 if layer is None else layer, jnp.int32), fmt=_FMT_CODES[w.fmt])


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, I] float32 (I a multiple of 32) as `native_dot` quantizes it: per block of
    32, d = max|x| / 127 and q = x * (127 / max|x|) rounded to nearest even (all in
    float32) -> (q int8 [M, I], d float32 [M, I/32])."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int8)
    return q.reshape(x.shape), (amax[..., 0] / np.float32(127)).astype(np.float32)


def dot_reference(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """What `native_dot` computes, in numpy: x quantized (`quantize_activations`), each
    block's integer product with w's blocks exact in int64, scaled by both blocks'
    scales and summed in float64 -> [M, O] float64."""
    q, d = quantize_activations(x)
    m, nb = d.shape
    o = math.prod(w.out_shape)
    xq = q.reshape(m, nb, BLOCK).astype(np.int64)
    data = np.asarray(w.data).reshape(o, -1)
    if w.fmt in _NIBBLES:
        b = data.reshape(o, nb, BLOCK // 2).astype(np.int64)
        wq = np.concatenate([b & 0xF, b >> 4], axis=-1)
        if w.fmt == "q4_0":
            wq = wq - 8
    else:
        wq = data.reshape(o, nb, BLOCK).astype(np.int64)
    dots = np.einsum("MBJ,OBJ->MOB", xq, wq)                       # exact integers
    if w.fmt == "int8":
        scaled = dots * d[:, None, :]
        return scaled.sum(-1) * np.asarray(w.scale, np.float64).reshape(1, o)
    dw = np.asarray(w.scale, np.float64).reshape(o, nb)
    y = (dots * dw[None] * d[:, None, :].astype(np.float64)).sum(-1)
    if w.fmt == "q4_1":   # + m * dx * sum(xq) per block
        sx = d.astype(np.float64) * xq.sum(-1)
        y = y + sx @ np.asarray(w.min, np.float64).reshape(o, nb).T
    return y


# --- sizes and placement -------------------------------------------------------------

def weight_bytes(params) -> int:
    """Bytes of every weight in a params tree (quantized ones at their stored size):
    what one decode step reads."""
    total = 0
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        total += leaf.nbytes if is_quantized(leaf) else int(leaf.size) * leaf.dtype.itemsize
    return total


def step_bytes(params, tied_embeddings: bool) -> int:
    """Weight bytes one decode step reads: every weight, but of an embedding that is
    not also the output head only the rows it looks up (counted as none)."""
    total = weight_bytes(params)
    if not tied_embeddings and "embed_tokens" in params:
        total -= weight_bytes({"e": params["embed_tokens"]})
    return total


def describe(params) -> str:
    """How a params tree's weights are held, e.g. "q4_1 x210, q8_0 x1, float x61"."""
    counts: dict[str, int] = {}
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        kind = leaf.fmt if is_quantized(leaf) else "float"
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def shardings_like(w: QuantizedWeight, float_sharding):
    """`float_sharding` (a NamedSharding of the float weight `w` stands for) for each
    part of `w`: output channels split as the float weight's, the contraction's blocks
    as its first contraction dim where they divide evenly (replicated otherwise), so
    the scales travel with their output channels and blocks."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = float_sharding.mesh
    spec = tuple(float_sharding.spec) + (None,) * (len(w.float_shape) - len(float_sharding.spec))
    out = [spec[i] for i in _out_dims(w.float_shape, w.in_dims)]
    in_axis = spec[w.in_dims[0]]

    def axis_size(axis) -> int:
        names = axis if isinstance(axis, tuple) else (axis,)
        return math.prod(mesh.shape[a] for a in names)

    def fits(dims, axes) -> bool:
        return all(a is None or d % axis_size(a) == 0 for d, a in zip(dims, axes))

    def part(a):
        if a is None:
            return None
        axes = [*out, in_axis]
        if not fits(a.shape, axes):
            axes[-1] = None
        if not fits(a.shape, axes):
            axes = [None] * a.ndim
        return NamedSharding(mesh, P(*axes))

    return QuantizedWeight(part(w.data), part(w.scale), part(w.min), w.fmt, w.float_shape,
                           w.in_dims)


def place(params, float_shardings):
    """`jax.device_put` of a params tree that may hold quantized weights, each on
    `shardings_like` its float weight's sharding."""
    def one(p, s):
        if is_quantized(p):
            return jax.device_put(p, shardings_like(p, s))
        return jax.device_put(p, s)
    return jax.tree.map(one, params, float_shardings, is_leaf=is_quantized)


def dequantize_params(params):
    """Every quantized weight of a params tree as the float weight it stands for."""
    return jax.tree.map(lambda a: dequantize(a) if is_quantized(a) else a, params,
                        is_leaf=is_quantized)


def cast_floats(params, dtype):
    """Float leaves cast to `dtype`; quantized weights kept as stored."""
    return jax.tree.map(lambda a: a if is_quantized(a) else a.astype(dtype), params,
                        is_leaf=is_quantized)
