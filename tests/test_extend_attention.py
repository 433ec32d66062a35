"""Prefill with context (`Llama.extend`): the cached prefix and the new tokens
are attended apart (`causal_attention(prefix=)`) and merged in one softmax; the result
must be what a plain causal pass over the whole sequence computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models.attention import QUERY_BLOCK, causal_attention
from jaxpd.models.config import ModelConfig
from jaxpd.models.layout import init_params
from jaxpd.models.llama import Llama


def test_new_tokens_after_a_prefix_attend_as_one_causal_sequence():
    """Rows with prefixes of different lengths (padded to one width), new tokens over
    more than one query block: each new token's output equals the causal attention of
    the row's whole sequence (prefix + new) at its position."""
    rng = np.random.default_rng(0)
    b, kh, g, h, width = 3, 2, 2, 16, 48
    t = QUERY_BLOCK + 40
    prefix_len = np.array([0, 17, width])
    q = rng.standard_normal((b, t, kh * g, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, t, kh, h)).astype(np.float32) for _ in range(2))
    k_pre, v_pre = (rng.standard_normal((b, width, kh, h)).astype(np.float32) for _ in range(2))
    attend = jax.jit(causal_attention)      # op by op, every op would compile alone
    out = np.asarray(attend(q, k, v, (k_pre, v_pre, jnp.asarray(prefix_len))))
    for row in range(b):
        n = prefix_len[row]
        whole_k = np.concatenate([k_pre[row:row + 1, :n], k[row:row + 1]], axis=1)
        whole_v = np.concatenate([v_pre[row:row + 1, :n], v[row:row + 1]], axis=1)
        whole_q = np.concatenate([np.zeros((1, n, kh * g, h), np.float32), q[row:row + 1]], 1)
        want = np.asarray(attend(whole_q, whole_k, whole_v))[0, n:]
        np.testing.assert_allclose(out[row], want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cached_pages", [0, 2])
def test_extend_equals_a_full_forward_and_writes_the_prefills_pages(cached_pages):
    """A prompt whose first `cached_pages` pages are in the pool (written by a plain
    prefill) extends with the rest: the last token's logits equal a full forward's, and
    the pages it writes hold what a plain prefill computes for those positions. With no
    prefix the call has a prefix table of no columns."""
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=256)
    params = init_params(cfg, seed=3)
    model = Llama(cfg)
    page, n = 8, 37
    prompt = np.random.default_rng(1).integers(1, 64, n).astype(np.int32)
    full = jax.jit(lambda p, x: model.apply({"params": p}, x, method=Llama.forward))(
        params, prompt[None])[0, -1]
    _, k_all, v_all = jax.jit(lambda p, x, lengths: model.apply(
        {"params": p}, x, lengths, method=Llama.prefill))(params, prompt[None], np.array([n]))
    pages = -(-n // page)
    shape = (cfg.num_layers, 1 + pages, page, cfg.num_kv_heads, cfg.head_dim)
    k_pool, v_pool = jnp.zeros(shape), jnp.zeros(shape)
    cached = cached_pages * page
    if cached:
        split = lambda x: x[:, 0, :cached].reshape(cfg.num_layers, cached_pages, page,
                                                   *shape[3:])
        k_pool = k_pool.at[:, 1:1 + cached_pages].set(split(k_all))
        v_pool = v_pool.at[:, 1:1 + cached_pages].set(split(v_all))
    new = prompt[cached:]
    bucket = 32 if len(new) <= 32 else 64
    tokens = np.zeros((2, bucket), np.int32)           # row 1: padding, to the null page
    tokens[0, :len(new)] = new
    prefix_tables = np.zeros((2, cached_pages), np.int32)
    prefix_tables[0] = np.arange(1, 1 + cached_pages)
    new_tables = np.zeros((2, bucket // page), np.int32)
    own = np.arange(1 + cached_pages, 1 + pages)
    new_tables[0, :len(own)] = own
    logits, k_pool, v_pool = jax.jit(lambda *a: model.apply(
        {"params": params}, *a, method=Llama.extend))(
        tokens, np.array([cached, 0]), np.array([len(new), 1]), k_pool, v_pool,
        prefix_tables, new_tables)
    np.testing.assert_allclose(logits[0], full, rtol=1e-4, atol=1e-4)
    written = np.asarray(k_pool)[:, own].reshape(cfg.num_layers, -1, *shape[3:])[:, :n - cached]
    np.testing.assert_allclose(written, np.asarray(k_all)[:, 0, cached:n], rtol=1e-5, atol=1e-5)
