"""Rotary position embeddings, Hugging Face (rotate-half) convention, with Llama 3 scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxpd.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """[H/2] float32 inverse frequencies, computed once on the host at trace time;
    `local`: of a sliding-window layer (`rope_local_theta`, no scaling)."""
    h = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.int64).astype(np.float32) / h))
    if local:
        return inv_freq.astype(np.float32)
    if cfg.rope_linear_factor != 1.0:    # linear scaling: positions / factor
        return (inv_freq / cfg.rope_linear_factor).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (same formula as the reference implementation).
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """x: [B, T, heads, H], positions: [B, T] -> x rotated, in x's dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]          # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
