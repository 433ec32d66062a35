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

This module declares the checkpoint layout of the params (separate projections);
`models/layout.py` holds every transform of that tree. The engine's decode meshes run
`fused=True` on params `layout.fuse_params` prepared once at load (one q/k/v matmul,
one gate/up matmul, a 2-D `o_proj`: `engine/programs/placement.py`).

Runs of equal layers may be *scanned*: `layout.stack_layers` stacks each run's params
under `stack_<start>_<stop>` (a leading L axis on every leaf, quantized weights too), and
every forward pass runs such a run as one `jax.lax.scan` of one layer body, so XLA
compiles one layer instead of L. The pool rides in the scan's carry and each step
writes and reads its own layer in place (the layer index is data).

Layer-wise prefill splits `prefill` into `embed_prompt`, `prefill_blocks` (a group of
layers, params passed as a list) and `head`, so each group's K/V can leave the device
while the next group computes.

Families differ by `ModelConfig` fields, read per layer by `Block`: q/k norms (Qwen3,
Gemma 3), (1 + w) norms, GeGLU, sandwich norms and scaled embeddings (Gemma), local
layers with a sliding window and their own RoPE base (Gemma 3), softcapping (Gemma 2
style), and mixture-of-experts MLPs (`models/moe.py`). A layer whose attention needs
a window or a softcap runs the reference core (`attention.py`) whatever core the
engine picked: the kernels take neither.
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpd.models.attention import (causal_attention, gather_pages, paged_attention,
                                    paged_attention_at, write_pages, write_prompt_pages)
from jaxpd.models.config import ModelConfig
from jaxpd.models.moe import ACTIVATIONS, grouped_experts, route
from jaxpd.models.quant import is_quantized, project, take_rows
from jaxpd.models.rope import apply_rope, inverse_frequencies


def _param(module: nn.Module, name: str, shape: Sequence[int], axes: tuple[str, ...],
           dtype, init=nn.initializers.normal(0.02)):
    # A quantized weight is applied as given: its shapes are not the float init's.
    if not module.is_initializing() and module.has_variable("params", name):
        value = module.get_variable("params", name)
        if is_quantized(value):
            return value
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


def constrain(x: jnp.ndarray, axes: tuple[str | None, ...]) -> jnp.ndarray:
    """Logical sharding hint for an activation (a no-op outside a mesh context)."""
    return nn.with_logical_constraint(x, axes)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (w times the normalised x, cast first); `plus_one`: Gemma's
    ((1 + w) times it in float32, then cast). `axis`: the logical axis of the scale."""
    eps: float
    dtype: jnp.dtype
    plus_one: bool = False
    axis: str = "embed"

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = _param(self, "scale", (x.shape[-1],), (self.axis,), self.dtype, init)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * x32.astype(x.dtype)


class Block(nn.Module):
    """One decoder layer, split at the attention core so the caller picks the core.

    `fused` reads the tree `layout.fuse_params` makes: q, k and v in one matmul, gate
    and up in another, and a 2-D `o_proj`; the checkpoint layout otherwise. `sparse`: the
    MLP is the mixture of experts (`cfg.is_sparse(layer)`), run by `experts`
    (`moe.grouped_experts`'s signature; the engine may hand an expert-parallel one)."""
    cfg: ModelConfig
    dtype: jnp.dtype
    fused: bool = False
    sparse: bool = False
    experts: Callable = grouped_experts
    # The product of a quantized weight (`models.quant.project`'s `native`) or None.
    qmatmul: Callable | None = None

    def _proj(self, spec, x, w):
        return project(x, w, spec, self.qmatmul)

    def setup(self):
        c, dt = self.cfg, self.dtype
        d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        zeros = nn.initializers.zeros
        norm = lambda axis="embed": RMSNorm(c.rms_norm_eps, dt, c.norm_plus_one, axis)
        self.input_norm = norm()
        self.post_norm = norm()
        if c.qk_norm:
            self.q_norm, self.k_norm = norm("head_dim"), norm("head_dim")
        if c.sandwich_norms:
            self.pre_ff_norm, self.post_ff_norm = norm(), norm()
        if self.sparse:
            self._setup_experts()
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
            if not self.sparse:
                self.w_gate_up = _param(self, "gate_up_proj", (d, 2, f), ("embed", None, "mlp"),
                                        dt)
        else:
            self.wq = _param(self, "q_proj", (d, n, h), ("embed", "heads", "head_dim"), dt)
            self.wk = _param(self, "k_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
            self.wv = _param(self, "v_proj", (d, k, h), ("embed", "kv_heads", "head_dim"), dt)
            self.wo = _param(self, "o_proj", (n, h, d), ("heads", "head_dim", "embed"), dt)
            if c.attention_bias:
                self.bq = _param(self, "q_bias", (n, h), ("heads", "head_dim"), dt, zeros)
                self.bk = _param(self, "k_bias", (k, h), ("kv_heads", "head_dim"), dt, zeros)
                self.bv = _param(self, "v_bias", (k, h), ("kv_heads", "head_dim"), dt, zeros)
            if not self.sparse:
                self.w_gate = _param(self, "gate_proj", (d, f), ("embed", "mlp"), dt)
                self.w_up = _param(self, "up_proj", (d, f), ("embed", "mlp"), dt)
        if not self.sparse:
            self.w_down = _param(self, "down_proj", (f, d), ("mlp", "embed"), dt)

    def _setup_experts(self):
        """A sparse layer's router [D, E], experts' gate/up [E, D, F'] and down
        [E, F', D], and the shared expert with its gate where the config has one."""
        c, dt = self.cfg, self.dtype
        d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.w_router = _param(self, "router", (d, e), ("embed", None), dt)
        self.w_experts_gate = self._expert_param("experts_gate", (e, d, f),
                                                 ("experts", "embed", "expert_mlp"))
        self.w_experts_up = self._expert_param("experts_up", (e, d, f),
                                               ("experts", "embed", "expert_mlp"))
        self.w_experts_down = self._expert_param("experts_down", (e, f, d),
                                                 ("experts", "expert_mlp", "embed"))
        fs = c.shared_expert_intermediate_size
        if fs:
            self.w_shared_gate = _param(self, "shared_gate_proj", (d, fs), ("embed", "shared_mlp"), dt)
            self.w_shared_up = _param(self, "shared_up_proj", (d, fs), ("embed", "shared_mlp"), dt)
            self.w_shared_down = _param(self, "shared_down_proj", (fs, d), ("shared_mlp", "embed"), dt)
            self.w_shared_weight = _param(self, "shared_expert_gate", (d, 1), ("embed", None), dt)

    def _expert_param(self, name: str, shape, axes):
        """An expert weight: declared whole at init; applied as given, since inside an
        expert-parallel program (`engine.programs.experts`) a device holds only its experts."""
        if self.is_initializing() or not self.has_variable("params", name):
            return _param(self, name, shape, axes, self.dtype)
        return self.get_variable("params", name)

    def qkv(self, x_BTD, positions_BT, inv_freq):
        """Normalised input -> rotated q [B,T,N,H], k [B,T,K,H] and v [B,T,K,H]."""
        x = self.input_norm(x_BTD)
        if self.fused:
            qkv = self._proj("BTD,DKCH->BTKCH", x, self.wqkv)
            if self.cfg.attention_bias:
                qkv = qkv + self.bqkv
            b, t = x.shape[:2]
            q = qkv[:, :, :, :-2].reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            q = self._proj("BTD,DNH->BTNH", x, self.wq)
            k = self._proj("BTD,DKH->BTKH", x, self.wk)
            v = self._proj("BTD,DKH->BTKH", x, self.wv)
            if self.cfg.attention_bias:
                q, k, v = q + self.bq, k + self.bk, v + self.bv
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.attn_scale is not None:
            # The cores scale scores by H ** -0.5; folding the rest into q keeps every
            # core (kernels included) right for another scale.
            q = q * jnp.asarray(self.cfg.attn_scale * self.cfg.head_dim ** 0.5, q.dtype)
        q = constrain(apply_rope(q, positions_BT, inv_freq), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions_BT, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def finish(self, x_BTD, attn_BTNH):
        """Output projection, residual, gated MLP (or the experts), residual; with
        sandwich norms each sub-layer's output is normed before its residual."""
        if self.cfg.sandwich_norms or self.sparse:
            return self._finish_by_parts(x_BTD, attn_BTNH)
        if self.fused:
            b, t = attn_BTNH.shape[:2]
            x = x_BTD + self._proj("BTE,ED->BTD", attn_BTNH.reshape(b, t, -1), self.wo)  # E = N*H
            gate_up = self._proj("BTD,DCF->BTCF", self.post_norm(x), self.w_gate_up)
            gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
        else:
            x = x_BTD + self._proj("BTNH,NHD->BTD", attn_BTNH, self.wo)
            y = self.post_norm(x)
            gate = self._proj("BTD,DF->BTF", y, self.w_gate)
            up = self._proj("BTD,DF->BTF", y, self.w_up)
        hidden = constrain(ACTIVATIONS[self.cfg.hidden_act](gate) * up, ("batch", "length", "mlp"))
        return x + self._proj("BTF,FD->BTD", hidden, self.w_down)

    def _finish_by_parts(self, x_BTD, attn_BTNH):
        if self.fused:
            b, t = attn_BTNH.shape[:2]
            out = self._proj("BTE,ED->BTD", attn_BTNH.reshape(b, t, -1), self.wo)  # E = N*H
        else:
            out = self._proj("BTNH,NHD->BTD", attn_BTNH, self.wo)
        if self.cfg.sandwich_norms:
            x = x_BTD + self.post_norm(out)
            y = self.pre_ff_norm(x)
        else:
            x = x_BTD + out
            y = self.post_norm(x)
        mlp = self._experts(y) if self.sparse else self._dense_mlp(y)
        if self.cfg.sandwich_norms:
            mlp = self.post_ff_norm(mlp)
        return x + mlp

    def _dense_mlp(self, y_BTD):
        if self.fused:
            gate_up = self._proj("BTD,DCF->BTCF", y_BTD, self.w_gate_up)
            gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
        else:
            gate = self._proj("BTD,DF->BTF", y_BTD, self.w_gate)
            up = self._proj("BTD,DF->BTF", y_BTD, self.w_up)
        hidden = constrain(ACTIVATIONS[self.cfg.hidden_act](gate) * up, ("batch", "length", "mlp"))
        return self._proj("BTF,FD->BTD", hidden, self.w_down)

    def _experts(self, y_BTD):
        """The mixture of experts on every token (padding too: its output is unread)."""
        c = self.cfg
        b, t, d = y_BTD.shape
        y = y_BTD.reshape(b * t, d)
        logits = jnp.einsum("TD,DE->TE", y, self.w_router)
        weights, ids = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        out = self.experts(y, ids, weights.astype(y.dtype), self.w_experts_gate,
                           self.w_experts_up, self.w_experts_down, 0, c.hidden_act,
                           native=self.qmatmul)
        if c.shared_expert_intermediate_size:
            gate = jnp.einsum("TD,DF->TF", y, self.w_shared_gate)
            up = jnp.einsum("TD,DF->TF", y, self.w_shared_up)
            shared = jnp.einsum("TF,FD->TD", ACTIVATIONS[c.hidden_act](gate) * up,
                                self.w_shared_down)
            out = out + jax.nn.sigmoid(jnp.einsum("TD,DO->TO", y, self.w_shared_weight)) * shared
        return out.reshape(b, t, d)


class Llama(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    fused: bool = False     # params as `layout.fuse_params` makes them (decode meshes)
    # The decode step's attention core: the reference or a Pallas kernel
    # (`models/pallas_attention.decode_attention`), all with the reference's signature.
    decode_attention: Callable = paged_attention
    # A prompt's causal attention without a cached prefix: the reference or the native
    # kernel (`engine.programs.kernels.prefill_attention`), (q, k, v) -> out as the reference.
    prefill_attention: Callable = causal_attention
    # A prefill with context's attention after a cached prefix read in place from the
    # pools, (q, k, v, k_pool, v_pool, layer, prefix_tables, prefix_len) -> out as
    # `causal_attention` with that prefix gathered (`native_attention.
    # prefix_attention_native` on each device's heads), or None: gather and reference.
    # Layers with a window or a softcap always take the reference.
    prefix_attention: Callable | None = None
    # A sparse layer's experts: `moe.grouped_experts` or an expert-parallel wrapper of it
    # (`engine.programs.experts`).
    experts: Callable = grouped_experts
    # The product of a quantized weight (`models.quant.project`'s `native`) or None:
    # the engine gives decode meshes the native CPU kernel where it serves.
    qmatmul: Callable | None = None

    def setup(self):
        c = self.cfg
        self.embedding = _param(self, "embed_tokens", (c.vocab_size, c.hidden_size),
                                ("vocab", "embed"), self.dtype)
        self.layers = [Block(c, self.dtype, self.fused, c.is_sparse(i), self.experts,
                             self.qmatmul, name=f"layers_{i}")
                       for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, c.norm_plus_one)
        if not c.tie_word_embeddings:
            self.lm_head = _param(self, "lm_head", (c.hidden_size, c.vocab_size),
                                  ("embed", "vocab"), self.dtype)
        self.inv_freq = inverse_frequencies(c)
        self.inv_freq_local = inverse_frequencies(c, local=True)

    def _rope(self, i: int):
        return self.inv_freq_local if self.cfg.is_sliding(i) else self.inv_freq

    def _embed(self, tokens):
        if is_quantized(self.embedding):
            x = take_rows(self.embedding, tokens, self.dtype)
        else:
            x = self.embedding[tokens]
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        return constrain(x, ("batch", "length", "embed"))

    def _logits(self, h_BD):
        h = self.norm(h_BD)
        if self.cfg.tie_word_embeddings:
            logits = project(h, self.embedding, "...D,VD->...V", self.qmatmul, jnp.float32)
        else:
            logits = project(h, self.lm_head, "...D,DV->...V", self.qmatmul, jnp.float32)
        return softcap_logits(self.cfg, logits)

    def _layers(self, x, state, layer_fn):
        """Every layer in order: `layer_fn(layer, i, kind, x, state) -> (x, state, out)`,
        `layer` with the `Block` methods `qkv` and `finish`, `i` its index (an int, or a
        traced int32 inside a scanned run: use it only as data, e.g. a pool index),
        `kind` a layer of the same kinds as i (an int: `attention_options`, `_rope`).
        Returns (x, state, outs stacked over layers, or None when layer_fn gives
        None)."""
        params = self.variables.get("params", {})
        outs = []
        for start, stop in layer_runs(self.cfg):
            key = stack_key(start, stop)
            if stop - start > 1 and key in params:
                def body(carry, i, stacked=params[key], start=start):
                    x, state = carry
                    p = jax.tree.map(lambda a: a[i - start], stacked)
                    block = Block(self.cfg, self.dtype, self.fused, self.cfg.is_sparse(start),
                                  self.experts, _in_stack(self.qmatmul, stacked, p, i - start),
                                  parent=None)
                    x, state, out = layer_fn(_Applied(block, p), i, start, x, state)
                    return (x, state), out
                (x, state), out = jax.lax.scan(body, (x, state),
                                               jnp.arange(start, stop, dtype=jnp.int32))
                outs.append(out)
                continue
            for i in range(start, stop):
                x, state, out = layer_fn(self.layers[i], i, i, x, state)
                outs.append(None if out is None else jax.tree.map(lambda a: a[None], out))
        if any(o is None for o in outs):
            return x, state, None
        return x, state, jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def _contiguous(self, tokens_BT):
        b, t = tokens_BT.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))

        def layer_fn(layer, i, kind, x, state):
            q, k, v = layer.qkv(x, positions, self._rope(kind))
            x = layer.finish(x, prompt_attention(self.cfg, kind, self.prefill_attention,
                                                 q, k, v))
            return x, state, (k, v)
        x, _, (k, v) = self._layers(self._embed(tokens_BT), (), layer_fn)
        return x, k, v

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
        pos = positions_B[:, None]

        def layer_fn(layer, i, kind, x, pools):
            k_pool, v_pool = pools
            q, k, v = layer.qkv(x, pos, self._rope(kind))
            k_pool = write_pages(k_pool, i, k[:, 0], block_tables_BP, positions_B)
            v_pool = write_pages(v_pool, i, v[:, 0], block_tables_BP, positions_B)
            options = attention_options(self.cfg, kind)
            if options or self.decode_attention is paged_attention:
                # The reference (which takes a window and a softcap), read from the
                # whole pool: a slice of layer i at a traced i would be a copy.
                attn = paged_attention_at(q[:, 0], k_pool, v_pool, i, block_tables_BP,
                                          positions_B + 1, **options)
            elif getattr(self.decode_attention, "whole_pool", False):   # reads layer i in place
                attn = self.decode_attention(q[:, 0], k_pool, v_pool, i, block_tables_BP,
                                             positions_B + 1)
            else:
                attn = self.decode_attention(q[:, 0], k_pool[i], v_pool[i], block_tables_BP,
                                             positions_B + 1)
            return layer.finish(x, attn[:, None]), (k_pool, v_pool), None
        x, (k_pool_LPSKH, v_pool_LPSKH), _ = self._layers(
            self._embed(tokens_B[:, None]), (k_pool_LPSKH, v_pool_LPSKH), layer_fn)
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

        def layer_fn(layer, i, kind, x, pools):
            k_pool, v_pool = pools
            q, k, v = layer.qkv(x, positions, self._rope(kind))
            k_pool = write_prompt_pages(k_pool, i, k, new_tables_BN, offsets, valid)
            v_pool = write_prompt_pages(v_pool, i, v, new_tables_BN, offsets, valid)
            # The prefix is read from the pool this layer's write returned (its pages
            # are not among those written): a read of the pool as it was before a write
            # makes XLA copy the whole pool to keep the write in place.
            options = attention_options(self.cfg, kind)
            if not prefix_tables_BW.shape[1]:
                # No prefix in the batch: a plain prompt's (the native kernel where used).
                attn = prompt_attention(self.cfg, kind, self.prefill_attention, q, k, v)
            elif self.prefix_attention is not None and not options:
                attn = self.prefix_attention(q, k, v, k_pool, v_pool, i, prefix_tables_BW,
                                             starts_B)
            else:
                prefix = (gather_pages(k_pool, i, prefix_tables_BW),
                          gather_pages(v_pool, i, prefix_tables_BW), starts_B)
                attn = causal_attention(q, k, v, prefix, **options)
            return layer.finish(x, attn), (k_pool, v_pool), None
        x, (k_pool_LPSKH, v_pool_LPSKH), _ = self._layers(
            self._embed(tokens_BT), (k_pool_LPSKH, v_pool_LPSKH), layer_fn)
        last = x[jnp.arange(x.shape[0]), lengths_B - 1]
        return self._logits(last), k_pool_LPSKH, v_pool_LPSKH


class _Applied:
    """A scanned run's `Block` with one layer's params (a slice of the stacked run),
    offering the bound layer's `qkv` and `finish`."""

    def __init__(self, block: Block, params):
        self.block, self.params = block, params

    def qkv(self, *args):
        return self.block.apply({"params": self.params}, *args, method=Block.qkv)

    def finish(self, *args):
        return self.block.apply({"params": self.params}, *args, method=Block.finish)


def _in_stack(qmatmul: Callable | None, stacked, layer_params, j):
    """`qmatmul` for one layer of a scanned run: a quantized weight of `layer_params`
    (layer j's slices of `stacked`) is multiplied in place in its stack (the kernel's
    `layer`), so no step copies a layer's weights out of the stack for the kernel. An
    expert weight's product names its expert (`layer=e`, `models.moe`): the stack's
    [L, E, ...] parts are read as [L*E, ...], entry j*E + e. A weight it cannot match
    goes to `qmatmul` as given."""
    if qmatmul is None:
        return None
    pairs = zip(jax.tree.leaves(layer_params, is_leaf=is_quantized),
                jax.tree.leaves(stacked, is_leaf=is_quantized))
    whole = {id(w.data): s for w, s in pairs if is_quantized(w)}

    def product(x, w, layer=None):
        s = whole.get(id(w.data))
        if s is None:
            return qmatmul(x, w) if layer is None else qmatmul(x, w, layer=layer)
        if layer is None:
            return qmatmul(x, s, layer=j)
        e = s.data.shape[1]
        flat = s.map_out(lambda a: a.reshape(-1, *a.shape[2:]), s.float_shape)
        return qmatmul(x, flat, layer=j * e + layer)
    return product


def layer_runs(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """[start, stop) of the maximal runs of consecutive layers of equal kinds (sliding,
    sparse): the runs `layout.stack_layers` stacks and the forward passes scan."""
    runs, start = [], 0
    for i in range(1, cfg.num_layers + 1):
        if i == cfg.num_layers or layer_kinds(cfg, i, i + 1) != layer_kinds(cfg, start, start + 1):
            runs.append((start, i))
            start = i
    return tuple(runs)


def stack_key(start: int, stop: int) -> str:
    """The params key of the stacked run of layers start .. stop - 1."""
    return f"stack_{start}_{stop}"


def attention_options(cfg: ModelConfig, layer: int) -> dict:
    """The reference cores' options layer `layer` needs (`window`, `softcap`); empty
    when any core serves it."""
    return _options(cfg, cfg.is_sliding(layer))


def _options(cfg: ModelConfig, sliding: bool) -> dict:
    options = {}
    if sliding:
        options["window"] = cfg.sliding_window
    if cfg.attn_softcap is not None:
        options["softcap"] = cfg.attn_softcap
    return options


def prompt_attention(cfg: ModelConfig, layer: int, attention: Callable, q, k, v):
    """A prompt's causal attention at layer `layer`: `attention` (the engine's core),
    or the reference with the options the layer needs."""
    options = attention_options(cfg, layer)
    return causal_attention(q, k, v, **options) if options else attention(q, k, v)


def softcap_logits(cfg: ModelConfig, logits):
    """Gemma's final logit softcapping, where the config has it."""
    cap = cfg.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def layer_kinds(cfg: ModelConfig, start: int, stop: int) -> tuple[tuple[bool, bool], ...]:
    """(sliding, sparse) of layers start .. stop - 1: what `prefill_blocks` compiles
    per layer (groups of equal kinds share a program)."""
    return tuple((cfg.is_sliding(i), cfg.is_sparse(i)) for i in range(start, stop))


def prefill_blocks(cfg: ModelConfig, dtype, layer_params: Sequence, x_BTD, fused: bool = False,
                   attention: Callable = causal_attention,
                   kinds: Sequence[tuple[bool, bool]] | None = None,
                   experts: Callable = grouped_experts):
    """Layer-wise prefill, middle programs: decoder layers over x, one per entry of
    `layer_params` (each a `layers_i` params dict, in order, fused or not as `fused`
    says), `attention` as `Llama.prefill_attention`, `kinds` their `layer_kinds`
    (None: every layer global and dense). Returns (x, k [G,B,T,K,H], v [G,B,T,K,H])
    for the G layers. The params are arguments, not names, so one compiled program
    serves every group of the same size and kinds."""
    kinds = kinds or ((False, False),) * len(layer_params)
    b, t = x_BTD.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    ks, vs = [], []
    for p, (sliding, sparse) in zip(layer_params, kinds):
        block = Block(cfg, dtype, fused, sparse, experts)
        inv_freq = inverse_frequencies(cfg, local=sliding)
        q, k, v = block.apply({"params": p}, x_BTD, positions, inv_freq, method=Block.qkv)
        options = _options(cfg, sliding)
        attn = causal_attention(q, k, v, **options) if options else attention(q, k, v)
        x_BTD = block.apply({"params": p}, x_BTD, attn, method=Block.finish)
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
