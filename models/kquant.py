"""GGUF's K-quant super-blocks re-read at load as `models.quant` block formats, so
projections and a mixture of experts' stacked experts stored in them stay quantized
(`models.gguf`).

A K-quant super-block holds 256 elements of a row in sub-blocks, each with its own
small integer scale (and min) under the super-block's float16 ones. Their products are
exact in float32, so each sub-block becomes one block of a plain format with a float32
scale, and the weight dequantizes to the values llama.cpp's dequantizer gives:

  Q4_K  144 bytes: d, dmin (f16), 12 bytes packing eight 6-bit (scale, min) pairs, then
        128 bytes of nibbles: 64-element chunk c holds sub-block 2c in the low nibbles
        of its 32 bytes and 2c + 1 in the high ones; element = d sc_j q - dmin m_j.
        -> `q4_k`: blocks of 32 in `q4_1`'s nibble layout (byte b: element b low, b + 16
        high), scale d sc_j and min -dmin m_j as float32.
  Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit high parts, sixteen int8
        scales, d (f16); element i = d sc_(i // 16) (q - 32), q 6 bits.
        -> `q6_k`: q - 32 as int8, one float32 scale d sc_j per 16 elements.

The native CPU product with float activations takes both (`native/quant_matmul.cc`);
the one with int8 activations does not (`quant.native_dot` hands them to the former).
"""
from __future__ import annotations

import numpy as np

SUPER = 256
# GGUF type -> (our format, bytes per super-block).
K_FORMATS = {"Q4_K": ("q4_k", 144), "Q6_K": ("q6_k", 210)}


def from_gguf_k_rows(raw: np.ndarray, qtype: str, rows: int, cols: int, name: str
                     ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's raw bytes (`rows` rows of `cols` elements in K-quant `qtype`) ->
    (format, data [rows, I'], scale [rows, nb] float32, min or None), the byte count
    checked against the shape first."""
    fmt, size = K_FORMATS[qtype]
    if cols % SUPER:
        raise ValueError(f"tensor {name!r}: rows of {cols} elements are not whole "
                         f"{qtype} super-blocks of {SUPER}")
    raw = np.asarray(raw)
    want = rows * (cols // SUPER) * size
    if raw.dtype != np.uint8 or raw.size != want:
        raise ValueError(f"tensor {name!r} ({qtype}, {rows} x {cols}) holds "
                         f"{raw.size * raw.dtype.itemsize} bytes, expected {want}: the "
                         f"file is corrupt or truncated")
    blocks = raw.reshape(-1, size)
    data, scale, low = _q4_k(blocks) if fmt == "q4_k" else _q6_k(blocks)
    return (fmt, data.reshape(rows, -1), scale.reshape(rows, -1),
            None if low is None else low.reshape(rows, -1))


def _f16(pair: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pair).view(np.float16).astype(np.float32)   # [N, 1]


def _q4_k(blocks: np.ndarray):
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].astype(np.uint8)
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 have
    # their low 4 bits in bytes 8-11 and their top 2 bits in the spare tops of 0-7.
    scales = np.concatenate([first & 63, (rest & 15) | ((first >> 6) << 4)], axis=1)
    mins = np.concatenate([second & 63, (rest >> 4) | ((second >> 6) << 4)], axis=1)
    chunks = blocks[:, 16:144].reshape(-1, 4, 32)
    q = np.stack([chunks & 15, chunks >> 4], axis=2).reshape(-1, 8, 32)    # [N, 8, 32]
    data = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)          # [N, 8, 16]
    return data, d * scales.astype(np.float32), -(dmin * mins.astype(np.float32))


def _q6_k(blocks: np.ndarray):
    low = blocks[:, 0:128].reshape(-1, 2, 64)                  # per 128-element half
    high = blocks[:, 128:192].reshape(-1, 2, 32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    # Element 32 r + l of a half (r = 0..3, l = 0..31): low nibble of byte l (r 0) or
    # l + 32 (r 1), high nibble of them (r 2, 3); its top 2 bits are bits 2r of high[l].
    nibbles = np.stack([low[..., :32] & 15, low[..., 32:] & 15,
                        low[..., :32] >> 4, low[..., 32:] >> 4], axis=2)  # [N, 2, 4, 32]
    tops = np.stack([(high >> (2 * r)) & 3 for r in range(4)], axis=2)
    q = (nibbles | (tops << 4)).astype(np.int16) - 32
    return q.astype(np.int8).reshape(-1, SUPER), d * scales, None
