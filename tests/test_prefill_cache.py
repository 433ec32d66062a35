"""The prefill mesh's own prefix cache (`engine.kv.paged_prefill`): only the
uncached tokens computed, on every mesh of the engine test, against transformers.
(Split from test_prefix_cache.py, sharing its helpers in tests/support, so that xdist's
one-file-per-worker scheduling has two halves to balance.)"""
import numpy as np
import pytest

from jaxpd import LLM
from tests.support.prefix_chats import chat, chats_at_once, check_pool, conversation, page_bytes


@pytest.mark.slow
def test_the_prefill_mesh_computes_only_what_its_own_cache_lacks(tiny_hf_model):
    """Every turn through the prefill mesh (tp=2; `prefix_extend_below=0`): its cache
    holds the previous turn's prompt pages, so it computes only the rest (counted
    tokens), and its handoff leaves out what the decode side holds (counted bytes).
    A turn whose new tokens need the whole bucket anyway computes everything, with no
    prefix (the last turn: 106 new tokens of 250, bucket 256; a prefix pays only when
    the new tokens fit a quarter of it). Outputs equal transformers'; both caches'
    books balance afterwards."""
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(7)
    system = rng.integers(3, 256, 100).tolist()
    users = [rng.integers(3, 256, n).tolist() for n in (5, 14, 23, 90)]
    with LLM(path, mesh="prefill=2,decode=1x2", max_model_len=256, slots_per_shard=2,
             enable_prefix_caching=True, prefix_extend_below=0, warmup=False) as llm:
        page = page_bytes(llm)
        conv, previous, hits = list(system), 0, []
        for t, user in enumerate(users):
            before = llm.stats()
            conv = chat(llm, hf_model, conv, [user], logprobs=2)
            after = llm.stats()
            prompt = len(conv) - 6
            d = {k: after[k] - before[k] for k in ("prefill_tokens", "prefill_cache_hit_tokens",
                                                   "prefill_cache_query_tokens", "transfer_bytes",
                                                   "prefix_saved_bytes", "local_prefills")}
            # The prefill mesh cached the full pages of the previous prompt (it never
            # sees the answers): exactly those are found, the rest is computed; on the
            # last turn the rest needs the whole 256 bucket, so nothing is used.
            cached = previous // 16 * 16 if t < 3 else 0
            assert d["prefill_cache_hit_tokens"] == cached, (t, d)
            assert d["prefill_tokens"] == prompt - cached
            assert d["prefill_cache_query_tokens"] == prompt and d["local_prefills"] == 0
            assert d["transfer_bytes"] + d["prefix_saved_bytes"] == -(-prompt // 16) * page
            assert (d["prefix_saved_bytes"] > 0) == (t > 0)
            previous = prompt
            hits.append(cached)
        assert previous == 250 and hits == [0, 96, 112, 0]
        stats = llm.stats()
        assert stats["prefill_pages_cached"] >= previous // 16
        assert stats["prefix_skip_misses"] == 0 and stats["prefix_evictions"] == 0
        check_pool(llm)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["prefill=4,decode=4", "prefill=2,decode=2x2", "colocated=4"])
def test_concurrent_chats_with_the_cache_match_hf_on_every_mesh_of_the_engine_test(
        tiny_hf_model, mesh):
    """test_engine's meshes, the cache on: two chats at once, every turn through the
    prefill mesh where there is one (tp=4 and tp=2 caches), the colocated mesh's
    prefill with context under dp=4. Every answer equals transformers'; both sides hit."""
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(8)
    # A long system prompt: each turn's new tokens fit a quarter of its bucket, so the
    # prefill mesh's hits pay (`PrefillLoop._run_cached`).
    chats = [conversation(rng, turns=3, system_len=100) for _ in range(2)]
    with LLM(path, mesh=mesh, max_model_len=256, slots_per_shard=2,
             enable_prefix_caching=True, prefix_extend_below=0, warmup=False) as llm:
        chats_at_once(llm, hf_model, chats)
        stats = llm.stats()
        assert stats["finished"] == 6 and stats["aborted"] == 0
        assert stats["prefix_hit_tokens"] > 0
        assert (stats["prefill_cache_hit_tokens"] > 0) == (not mesh.startswith("colocated"))
        check_pool(llm)


def test_a_prefill_cache_too_small_for_the_largest_batch_is_refused(tiny_hf_model):
    path, _ = tiny_hf_model
    with pytest.raises(ValueError, match="prefill_cache_pages=8 cannot hold"):
        LLM(path, mesh="prefill=1,decode=1", max_model_len=96, enable_prefix_caching=True,
            prefill_cache_pages=8, warmup=False)
