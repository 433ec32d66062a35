"""Long prompts on a prefill mesh, prefilled in chunks that attend to the pages of the
chunks before them: the same greedy tokens as transformers, programs bounded by the
chunk (not by max_model_len), none compiled while serving, no page kept."""
import threading

import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import kv_page_bytes
from jaxpd.engine.compile.background import settle
from jaxpd.engine.kv.paged_prefill import chunk_width, chunk_widths
from jaxpd.engine.scheduling.scheduler import PrefillScheduler
from jaxpd.request import Request, State
from tests.engine_fixtures import assert_all_pages_free
from tests.hf_fixtures import hf_greedy

LONG = dict(max_model_len=4096, page_size=64, prefill_chunk_tokens=256, slots_per_shard=2)


def _greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def long_model(hf_models):
    return hf_models("llama_gqa", max_position_embeddings=4096)


def test_chunk_widths_double_from_one_chunk_up_to_the_slot():
    assert chunk_widths(4, 64) == [4, 8, 16, 32, 64]
    assert chunk_widths(4, 50) == [4, 8, 16, 32, 50]
    assert [chunk_width(p, 4, 64) for p in (0, 1, 4, 5, 8, 9, 33, 64)] == \
        [0, 4, 4, 8, 8, 16, 64, 64]


def test_a_prompt_past_the_largest_bucket_waits_in_its_own_lane_and_leaves_alone():
    sched = PrefillScheduler([16, 32, 64], max_batch=4, max_tokens=256, bucket_timeout_s=1.0,
                             chunked=True)
    short = Request("short", [5] * 10, SamplingParams())
    long = Request("long", [5] * 300, SamplingParams())
    later = Request("later", [5] * 500, SamplingParams())
    for r in (long, short, later):
        sched.add(r)
    assert len(sched) == 3
    batch, _ = sched.schedule(now=0.0)                 # the oldest is the long one: due
    assert batch.chunked and batch.requests == [long] and batch.batch_size == 1
    batch, wait = sched.schedule(now=0.0, long_ok=False)   # one in progress: held
    assert batch is None and wait > 0
    later.abort("client")
    assert sched.drop_final() == [later] and len(sched) == 1
    with pytest.raises(ValueError, match="longer than the largest prefill bucket"):
        PrefillScheduler([16, 32], 4, 64).add(long)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,caching", [
    ("prefill=1,decode=1", True),
    pytest.param("prefill=2,decode=2", False, marks=pytest.mark.matrix)])
def test_long_prompts_in_chunks_match_hf_and_compile_nothing_while_serving(long_model, mesh,
                                                                         caching):
    path, hf_model = long_model
    rng = np.random.default_rng(0)
    lengths = [3000, 700, 40, 2049, 256, 257]
    prompts = [rng.integers(3, 256, size=n).tolist() for n in lengths]
    with LLM(path, mesh=mesh, warmup=True, enable_prefix_caching=caching, **LONG) as llm:
        engine = llm.engine
        assert engine.prefill_scheduler.buckets[-1] == 256 and engine.prefill_scheduler.chunked
        settle(engine, 900)      # the chunk programs compile in the background
        compiled = engine.counter.counts()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(6))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf_model, prompt, 6), len(prompt)
        if caching:          # the repeat of the longest reuses its pages, same tokens
            again = llm.generate(prompt_token_ids=prompts[:1], sampling_params=_greedy(6))
            assert again[0].token_ids == outs[0].token_ids
            assert llm.stats()["prefill_cache_hit_tokens"] >= 2944
        assert engine.counter.counts() == compiled
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_a_chunked_prompt_aborted_between_chunks_frees_every_page(long_model):
    path, _ = long_model
    with LLM(path, mesh="prefill=1,decode=1", enable_prefix_caching=False, **LONG,
             warmup=False) as llm:
        cache = llm.engine.prefill_cache
        chunks, aborted = [], threading.Event()
        run_chunk = cache.run_chunk

        def abort_after_the_second(*args):
            out = run_chunk(*args)
            chunks.append(args[1])
            if len(chunks) == 2:
                assert llm.abort(request.request_id, "client went away")
                aborted.set()
            return out

        cache.run_chunk = abort_after_the_second
        request = llm.submit(Request(llm.new_request_id(), [7] * 1500, _greedy(4)))
        assert aborted.wait(120)
        assert_all_pages_free(llm)
        assert request.state is State.ABORTED and request.output_ids == []
        assert chunks == [0, 256]                  # no chunk ran after the abort
        cache.run_chunk = run_chunk                # the engine serves on
        out = llm.generate(prompt_token_ids=[[7] * 600], sampling_params=_greedy(3))[0]
        assert len(out.token_ids) == 3
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_penalties_and_logprobs_of_a_chunked_prompt_equal_the_unchunked_prefill(long_model):
    path, _ = long_model
    prompt = np.random.default_rng(3).integers(3, 40, size=900).tolist()
    params = _greedy(8, repetition_penalty=1.3, presence_penalty=0.4, logprobs=3)
    results = []
    for chunk in (256, 1024):                     # 1024: one bucket holds the prompt
        with LLM(path, mesh="prefill=1,decode=1", **{**LONG, "max_model_len": 1024,
                                                     "prefill_chunk_tokens": chunk},
                 warmup=False) as llm:
            assert llm.engine.prefill_scheduler.chunked == (chunk == 256)
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            results.append((out.token_ids, [lp[0] for lp in out.logprobs]))
            assert_all_pages_free(llm)
    (chunked, lp_c), (whole, lp_w) = results
    assert chunked == whole
    np.testing.assert_allclose(lp_c, lp_w, atol=1e-4)


@pytest.mark.slow
def test_the_models_context_by_default_capped_by_the_kv_budget(long_model):
    path, hf_model = long_model
    with LLM(path, mesh="prefill=1,decode=1", page_size=64, warmup=False) as llm:
        assert llm.config.max_model_len == 4096            # the model's, not 1,024
    page = kv_page_bytes(num_layers=2, num_kv_heads=2, head_dim=8, page_size=64,
                         dtype="float32")
    with LLM(path, mesh="prefill=1,decode=1", page_size=64, prefill_chunk_tokens=512,
             kv_cache_memory=41 * page, warmup=False) as llm:
        assert (llm.config.max_model_len, llm.config.pages_per_shard) == (40 * 64, 41)
        prompt = np.random.default_rng(5).integers(3, 256, size=2000).tolist()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(4))[0]
        assert out.token_ids == hf_greedy(hf_model, prompt, 4)
        with pytest.raises(ValueError, match="2559"):     # max_prompt_len
            llm.generate(prompt_token_ids=[[5] * 2600], sampling_params=_greedy(1))
        assert_all_pages_free(llm)
