"""Llama-family transformer in Flax (linen), speaking only logical axis names.

Parameters carry logical axes (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`,
`vocab`); `sharding/` maps them onto a role's mesh. Three entry points, each a pure
function of `params` once wrapped by `model.apply`:

- `forward(tokens)`              full logits [B, T, V], no cache (tests, reference).
- `prefill(tokens, lengths)`     logits of each row's last real token [B, V] and the
                                 prompt's K and V, [L, B, T, K, H] each.
- `decode(tokens, positions, k_pool, v_pool, block_tables)`
                                 one token per slot against the paged pool; returns
                                 logits [B, V] and the updated pools (donate them).

The engine's decode meshes run `fused=True` on params `fuse_params` prepared once at
load (one q/k/v matmul, one gate/up matmul, a 2-D `o_proj`: `engine/placement.py`);
checkpoints and `init_params` keep the separate projections of the checkpoint layout.

Layer-wise prefill splits `prefill` into `embed_prompt`, `prefill_blocks` (a group of
layers, params passed as a list) and `head`, so each group's K/V can leave the device
while the next group computes.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpd.models.attention import (causal_attention, gather_pages, paged_attention,
                                    write_pages, write_prompt_pages)
from jaxpd.models.config import ModelConfig
from jaxpd.models.rope import apply_rope, inverse_frequencies


def _param(module: nn.Module, name: str, shape: Sequence[int], axes: tuple[str, ...],
           dtype, init=nn.initializers.normal(0.02)):
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


def constrain(x: jnp.ndarray, axes: tuple[str | None, ...]) -> jnp.ndarray:
    """Logical sharding hint for an activation (a no-op outside a mesh context)."""
    return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", (x.shape[-1],), ("embed",), self.dtype, nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


class Block(nn.Module):
    """One decoder layer, split at the attention core so the caller picks the core.

    `fused` reads the tree `fuse_params` makes: q, k and v in one matmul, gate and up in
    another, and a 2-D `o_proj`; the checkpoint layout otherwise."""
    cfg: ModelConfig
    dtype: jnp.dtype
    fused: bool = False

    def setup(self):
        c, dt = self.cfg, self.dtype
        d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        zeros = nn.initializers.zeros
        self.input_norm = RMSNorm(c.rms_norm_eps, dt)
        self.post_norm = RMSNorm(c.rms_norm_eps, dt)
        if self.fused:
            # Axis C = N/K + 2: each kv head's query heads, then its k and its v, so a
            # tp shard of kv heads holds every head it attends with.
            group = n // k + 2
            self.wqkv = _param(self, "qkv_proj", (d, k, group, h),
                               ("embed", "kv_heads", None, "head_dim"), dt)
            self.wo = _param(self, "o_proj", (n * h, d), ("heads", "embed"), dt)
            if c.attention_bias:
                self.bqkv = _param(self, "qkv_bias", (k, group, h),
                                   ("kv_heads", None, "head_dim"), dt, zeros)
            self.w_gate_up = _param(self, "gate_up_proj", (d, 2, f), ("embed", None, "mlp"), dt)
        else:
            self.wq = _param(self, "q_proj", (d, n, h), ("embed", "heads", "head_dim"), dt)
            self.wk = _param(self, "k_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
            self.wv = _param(self, "v_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
            self.wo = _param(self, "o_proj", (n, h, d), ("heads", "head_dim", "embed"), dt)
            if c.attention_bias:
                self.bq = _param(self, "q_bias", (n, h), ("heads", "head_dim"), dt, zeros)
                self.bk = _param(self, "k_bias", (k, h), ("kv_heads", "head_dim"), dt, zeros)
                self.bv = _param(self, "v_bias", (k, h), ("kv_heads", "head_dim"), dt, zeros)
            self.w_gate = _param(self, "gate_proj", (d, f), ("embed", "mlp"), dt)
            self.w_up = _param(self, "up_proj", (d, f), ("embed", "mlp"), dt)
        self.w_down = _param(self, "down_proj", (f, d), ("mlp", "embed"), dt)

    def qkv(self, x_BTD, positions_BT, inv_freq):
        """Normalised input -> rotated q [B,T,N,H], k [B,T,K,H] and v [B,T,K,H]."""
        x = self.input_norm(x_BTD)
        if self.fused:
            qkv = jnp.einsum("BTD,DKCH->BTKCH", x, self.wqkv)
            if self.cfg.attention_bias:
                qkv = qkv + self.bqkv
            b, t = x.shape[:2]
            q = qkv[:, :, :, :-2].reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            q = jnp.einsum("BTD,DNH->BTNH", x, self.wq)
            k = jnp.einsum("BTD,DKH->BTKH", x, self.wk)
            v = jnp.einsum("BTD,DKH->BTKH", x, self.wv)
            if self.cfg.attention_bias:
                q, k, v = q + self.bq, k + self.bk, v + self.bv
        q = constrain(apply_rope(q, positions_BT, inv_freq), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions_BT, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def finish(self, x_BTD, attn_BTNH):
        """Output projection, residual, SwiGLU MLP, residual."""
        if self.fused:
            b, t = attn_BTNH.shape[:2]
            x = x_BTD + jnp.einsum("BTE,ED->BTD", attn_BTNH.reshape(b, t, -1), self.wo)  # E = N*H
            gate_up = jnp.einsum("BTD,DCF->BTCF", self.post_norm(x), self.w_gate_up)
            gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
        else:
            x = x_BTD + jnp.einsum("BTNH,NHD->BTD", attn_BTNH, self.wo)
            y = self.post_norm(x)
            gate = jnp.einsum("BTD,DF->BTF", y, self.w_gate)
            up = jnp.einsum("BTD,DF->BTF", y, self.w_up)
        hidden = constrain(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return x + jnp.einsum("BTF,FD->BTD", hidden, self.w_down)


class Llama(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    fused: bool = False     # params as `fuse_params` makes them (what decode meshes run)
    # The decode step's attention core: the reference or a Pallas kernel
    # (`models/pallas_attention.decode_attention`), all with the reference's signature.
    decode_attention: Callable = paged_attention
    # A prompt's causal attention without a cached prefix: the reference or the native
    # kernel (`engine.kernels.prefill_attention`), (q, k, v) -> out as the reference.
    prefill_attention: Callable = causal_attention

    def setup(self):
        c = self.cfg
        self.embedding = _param(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                                ("vocab", "embed"), self.dtype)
        self.layers = [Block(c, self.dtype, self.fused, name=f"layers_{i}")
                       for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _param(self, "lm_head", (c.hidden_size, c.vocab_size),
                                  ("embed", "vocab"), self.dtype)
        self.inv_freq = inverse_frequencies(c)

    def _embed(self, tokens):
        return constrain(self.embedding[tokens], ("batch", "length", "embed"))

    def _logits(self, h_BD):
        h = self.norm(h_BD)
        if self.cfg.tie_word_embeddings:
            logits = jnp.einsum("...D,VD->...V", h, self.embedding, preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("...D,DV->...V", h, self.lm_head, preferred_element_type=jnp.float32)
        return logits

    def _contiguous(self, tokens_BT):
        b, t = tokens_BT.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self._embed(tokens_BT)
        ks, vs = [], []
        for layer in self.layers:
            q, k, v = layer.qkv(x, positions, self.inv_freq)
            x = layer.finish(x, self.prefill_attention(q, k, v))
            ks.append(k)
            vs.append(v)
        return x, jnp.stack(ks), jnp.stack(vs)

    def forward(self, tokens_BT):
        """Full causal forward: logits [B, T, V] (float32)."""
        x, _, _ = self._contiguous(tokens_BT)
        return self._logits(x)

    def prefill(self, tokens_BT, lengths_B):
        """Padded prompts -> (last-token logits [B, V], k [L,B,T,K,H], v [L,B,T,K,H])."""
        x, k, v = self._contiguous(tokens_BT)
        last = x[jnp.arange(x.shape[0]), lengths_B - 1]          # [B, D]
        return self._logits(last), k, v

    def embed_prompt(self, tokens_BT):
        """Layer-wise prefill, first program: token embeddings [B, T, D]."""
        return self._embed(tokens_BT)

    def head(self, x_BTD, lengths_B):
        """Layer-wise prefill, last program: logits of each row's last real token [B, V]."""
        return self._logits(x_BTD[jnp.arange(x_BTD.shape[0]), lengths_B - 1])

    def decode(self, tokens_B, positions_B, k_pool_LPSKH, v_pool_LPSKH, block_tables_BP):
        """One step: token b sits at positions[b]; its K/V are written, then attended with
        everything before it. Returns (logits [B, V], k_pool, v_pool)."""
        x = self._embed(tokens_B[:, None])                       # [B, 1, D]
        pos = positions_B[:, None]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, pos, self.inv_freq)
            k_pool_LPSKH = write_pages(k_pool_LPSKH, i, k[:, 0], block_tables_BP, positions_B)
            v_pool_LPSKH = write_pages(v_pool_LPSKH, i, v[:, 0], block_tables_BP, positions_B)
            if getattr(self.decode_attention, "whole_pool", False):   # reads layer i in place
                attn = self.decode_attention(q[:, 0], k_pool_LPSKH, v_pool_LPSKH, i,
                                             block_tables_BP, positions_B + 1)
            else:
                attn = self.decode_attention(q[:, 0], k_pool_LPSKH[i], v_pool_LPSKH[i],
                                             block_tables_BP, positions_B + 1)
            x = layer.finish(x, attn[:, None])
        return self._logits(x[:, 0]), k_pool_LPSKH, v_pool_LPSKH

    def extend(self, tokens_BT, starts_B, lengths_B, k_pool_LPSKH, v_pool_LPSKH,
               prefix_tables_BW, new_tables_BN):
        """Prefill with context (prefix caching): row b's `lengths[b]` new tokens sit at
        positions starts[b], starts[b] + 1, ...; its prefix's K/V already fill the pages
        `prefix_tables[b]` (starts[b] tokens: whole pages, so `starts` is a multiple of
        the page size). The new K/V are written into the pages `new_tables[b]` (the
        page of new token i is `new_tables[b, i // page_size]`) and attended causally,
        after the prefix. `prefix_tables` may have no columns (no row has a prefix):
        then it is a plain prefill into pages. Returns (logits of each row's last new
        token [B, V], k_pool, v_pool)."""
        t = tokens_BT.shape[1]
        offsets = jnp.broadcast_to(jnp.arange(t)[None, :], tokens_BT.shape)
        positions = starts_B[:, None] + offsets
        valid = offsets < lengths_B[:, None]
        x = self._embed(tokens_BT)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, positions, self.inv_freq)
            k_pool_LPSKH = write_prompt_pages(k_pool_LPSKH, i, k, new_tables_BN, offsets, valid)
            v_pool_LPSKH = write_prompt_pages(v_pool_LPSKH, i, v, new_tables_BN, offsets, valid)
            prefix = None
            if prefix_tables_BW.shape[1]:
                # Read from the pool this layer's write returned (the prefix pages are
                # not among those written): a read of the pool as it was before a write
                # makes XLA copy the whole pool to keep the write in place.
                prefix = (gather_pages(k_pool_LPSKH, i, prefix_tables_BW),
                          gather_pages(v_pool_LPSKH, i, prefix_tables_BW), starts_B)
            # With no prefix in the batch, a plain prompt's (the native kernel where used).
            attn = (causal_attention(q, k, v, prefix) if prefix is not None
                    else self.prefill_attention(q, k, v))
            x = layer.finish(x, attn)
        last = x[jnp.arange(x.shape[0]), lengths_B - 1]
        return self._logits(last), k_pool_LPSKH, v_pool_LPSKH


def prefill_blocks(cfg: ModelConfig, dtype, layer_params: Sequence, x_BTD, fused: bool = False,
                   attention: Callable = causal_attention):
    """Layer-wise prefill, middle programs: decoder layers over x, one per entry of
    `layer_params` (each a `layers_i` params dict, in order, fused or not as `fused`
    says), `attention` as `Llama.prefill_attention`. Returns (x, k [G,B,T,K,H],
    v [G,B,T,K,H]) for the G layers. The params are arguments, not names, so one compiled
    program serves every group of the same size."""
    block = Block(cfg, dtype, fused)
    b, t = x_BTD.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    inv_freq = inverse_frequencies(cfg)
    ks, vs = [], []
    for p in layer_params:
        q, k, v = block.apply({"params": p}, x_BTD, positions, inv_freq, method=Block.qkv)
        x_BTD = block.apply({"params": p}, x_BTD, attention(q, k, v), method=Block.finish)
        ks.append(k)
        vs.append(v)
    return x_BTD, jnp.stack(ks), jnp.stack(vs)


def layer_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """[start, stop) of `num_groups` contiguous layer groups, sizes differing by at most
    one (larger first), so at most two group programs are compiled."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    n = min(num_groups, num_layers)
    size, extra = divmod(num_layers, n)
    bounds, start = [], 0
    for g in range(n):
        stop = start + size + (g < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def can_fuse(rules) -> bool:
    """Whether `fuse_params`'s tree shards correctly under these logical rules: its
    qkv weight splits over kv heads, so query heads must split the same way (both over
    tp, or both replicated). Where only query heads divide tp, the checkpoint layout
    keeps them split and k, v replicated instead."""
    rules = dict(rules)
    return rules.get("heads") == rules.get("kv_heads")


def fuse_params(cfg: ModelConfig, params):
    """Checkpoint params -> the tree `Llama(fused=True)` reads: per layer `qkv_proj`
    [D, K, N/K + 2, H] (kv head k's query heads k*N/K ..., then its k, then its v),
    `qkv_bias` [K, N/K + 2, H] with attention bias, `gate_up_proj` [D, 2, F], `o_proj`
    [N*H, D]. A pure function, run once where the engine places params on a mesh;
    checkpoints on disk keep the separate projections."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def grouped(wq, wk, wv):    # [..., N, H], [..., K, H] x2 -> [..., K, N/K + 2, H]
        wq = wq.reshape(*wq.shape[:-2], k, n // k, h)
        return jnp.concatenate([wq, wk[..., None, :], wv[..., None, :]], axis=-2)

    def layer(p):
        p = dict(p)
        p["qkv_proj"] = grouped(p.pop("q_proj"), p.pop("k_proj"), p.pop("v_proj"))
        if cfg.attention_bias:
            p["qkv_bias"] = grouped(p.pop("q_bias"), p.pop("k_bias"), p.pop("v_bias"))
        p["o_proj"] = p["o_proj"].reshape(n * h, d)
        p["gate_up_proj"] = jnp.stack([p.pop("gate_proj"), p.pop("up_proj")], axis=1)
        return p

    return {name: layer(p) if name.startswith("layers_") else p for name, p in params.items()}


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, fused: bool = False):
    """Shapes/dtypes of the params tree (no allocation) and its logical PartitionSpecs;
    `fused`: of the tree `fuse_params` makes."""
    model = Llama(cfg, dtype, fused)
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                              method=Llama.forward))["params"]
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Random params (normal(0.02) matrices, unit norms): tests and the placeholder model."""
    model = Llama(cfg, dtype)
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 1), jnp.int32),
                           method=Llama.forward)
    return nn.unbox(variables["params"])
