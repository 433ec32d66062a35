"""Fused weights (`fuse_params`, `Llama(fused=True)`) compute what the checkpoint layout
computes: prefill and decode logits and K/V, with and without attention bias, on one
device and on tp meshes whose kv heads do and do not divide tp."""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxpd.engine.programs.placement import place_params
from jaxpd.models.config import ModelConfig
from jaxpd.models.layout import abstract_params, fuse_params, init_params
from jaxpd.models.llama import Llama, prefill_blocks

CFG = ModelConfig("llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=128)
PAGE = 8


def _params(cfg, seed=0):
    params = init_params(cfg, seed)
    if cfg.attention_bias:     # init_params makes zero biases: make them count
        keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 3 * cfg.num_layers))
        params = {name: {k: (0.5 * jax.random.normal(next(keys), w.shape) if k.endswith("_bias")
                             else w) for k, w in p.items()} if name.startswith("layers_") else p
                  for name, p in params.items()}
    return params


@functools.partial(jax.jit, static_argnums=(0, 2))      # one compile, not op by op
def _run(cfg, params, fused, tokens, lengths):
    """Prefill of `tokens` [B, T], then one decode step of token 5 per row after its
    prompt, into a paged pool: (prefill logits, k, v, decode logits, k_pool)."""
    model = Llama(cfg, fused=fused)
    b, t = tokens.shape
    logits, k, v = model.apply({"params": params}, tokens, lengths, method=Llama.prefill)
    pages = t // PAGE + 1
    shape = (cfg.num_layers, b * pages + 1, PAGE, cfg.num_kv_heads, cfg.head_dim)
    tables = (1 + jnp.arange(b * pages, dtype=jnp.int32)).reshape(b, pages)
    fill = lambda x: jnp.zeros(shape).at[:, 1:].set(
        jnp.pad(x, ((0, 0), (0, 0), (0, pages * PAGE - t), (0, 0), (0, 0)))
        .reshape(cfg.num_layers, b * pages, PAGE, *shape[3:]))
    step, k_pool, _ = model.apply({"params": params}, jnp.full((b,), 5, jnp.int32), lengths,
                                  fill(k), fill(v), tables, method=Llama.decode)
    return logits, k, v, step, k_pool


def _close(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_fuse_params_matches_the_fused_model_tree():
    cfg = dataclasses.replace(CFG, attention_bias=True)
    fused = fuse_params(cfg, init_params(cfg))
    shapes, logical = abstract_params(cfg, fused=True)
    assert jax.tree.map(lambda a: a.shape, fused) == jax.tree.map(lambda a: a.shape, shapes)
    layer = logical["layers_0"]
    assert tuple(layer["qkv_proj"]) == ("embed", "kv_heads", None, "head_dim")
    assert tuple(layer["o_proj"]) == ("heads", "embed")
    assert tuple(layer["gate_up_proj"]) == ("embed", None, "mlp")


@pytest.mark.slow
@pytest.mark.parametrize("bias", [False, True])
def test_fused_equals_unfused(bias):
    cfg = dataclasses.replace(CFG, attention_bias=bias)
    params = _params(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 1, cfg.vocab_size)
    lengths = jnp.array([16, 11], jnp.int32)
    _close(_run(cfg, fuse_params(cfg, params), True, tokens, lengths),
           _run(cfg, params, False, tokens, lengths))


@pytest.mark.slow
def test_fused_prefill_blocks():
    cfg = dataclasses.replace(CFG, attention_bias=True)
    params = _params(cfg)
    fused = fuse_params(cfg, params)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 16, cfg.hidden_size))
    layers = lambda p: [p[f"layers_{i}"] for i in range(cfg.num_layers)]
    _close(prefill_blocks(cfg, jnp.float32, layers(fused), x, fused=True),
           prefill_blocks(cfg, jnp.float32, layers(params), x))


# Eager flax applies on 8 virtual devices compile op by op: seconds each, so CI only.
@pytest.mark.slow
@pytest.mark.parametrize("tp,num_heads,num_kv_heads,bias,fused", [
    (2, 8, 4, True, True),     # kv heads divide tp: each shard holds its q, k and v heads
    # Only query heads divide tp: the checkpoint layout instead.
    (4, 8, 2, True, False),
])
def test_fused_on_a_tp_mesh(tp, num_heads, num_kv_heads, bias, fused):
    cfg = dataclasses.replace(CFG, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              attention_bias=bias)
    params = _params(cfg)
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    placed, rules, is_fused = place_params(cfg, params, mesh, jnp.float32, fuse=True)
    assert is_fused == fused
    if fused and num_kv_heads % tp == 0:
        qkv = placed["layers_0"]["qkv_proj"]
        assert {s.data.shape[1] for s in qkv.addressable_shards} == {num_kv_heads // tp}
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 16), 1, cfg.vocab_size)
    lengths = jnp.array([16, 9], jnp.int32)

    def run(p, t, n):      # as the runners call it: shardings from the placed params
        with nn.logical_axis_rules(rules):
            return _run(cfg, p, is_fused, t, n)

    _close(jax.jit(run)(placed, tokens, lengths), _run(cfg, params, False, tokens, lengths))
