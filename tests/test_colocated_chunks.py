"""Colocated serving with chunked prefill (`chunked_prefill_tokens`): every prompt is
prefilled into its slot on the one mesh, at most one chunk between two decode steps;
the same greedy tokens as transformers, the running streams stepped between chunks,
nothing compiled while serving, no page kept."""
import threading

import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig
from jaxpd.engine.compile.background import settle
from jaxpd.request import Request, State
from tests.engine_fixtures import assert_all_pages_free
from tests.hf_fixtures import hf_greedy

CHUNKED = dict(max_model_len=2048, page_size=64, chunked_prefill_tokens=256,
               slots_per_shard=4)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_model(hf_models):
    return hf_models("llama_gqa", max_position_embeddings=2048)


def test_chunked_prefill_tokens_is_a_colocated_power_of_two():
    config = EngineConfig(mesh="colocated=2", chunked_prefill_tokens=512)
    assert config.chunked_prefill_tokens == 512
    with pytest.raises(ValueError, match="chunked_prefill_tokens is for colocated meshes"):
        EngineConfig(mesh="prefill=1,decode=1", chunked_prefill_tokens=512)
    for bad in (8, 300):
        with pytest.raises(ValueError, match="chunked_prefill_tokens must be a power of two"):
            EngineConfig(mesh="colocated=2", chunked_prefill_tokens=bad)


@pytest.mark.slow
@pytest.mark.parametrize("caching", [False, True])
def test_colocated_chunks_match_hf_and_compile_nothing_while_serving(long_model, caching):
    path, hf_model = long_model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (1500, 40, 700, 257, 1)]
    with LLM(path, mesh="colocated=2", warmup=True, enable_prefix_caching=caching,
             **CHUNKED) as llm:
        engine = llm.engine
        assert engine.prefill_loop is None and engine.decode_loop.extend.buckets[-1] == 256
        settle(engine)
        compiled = engine.counter.counts()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(6))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf_model, prompt, 6), len(prompt)
        if caching:                  # a repeat starts from the cached pages, same tokens
            again = llm.generate(prompt_token_ids=prompts[:1], sampling_params=_greedy(6))
            assert again[0].token_ids == outs[0].token_ids
            assert llm.stats()["prefix_hit_tokens"] >= 1408
        assert engine.counter.counts() == compiled
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_a_running_stream_steps_between_the_chunks_of_a_long_prompt(long_model):
    path, hf_model = long_model
    with LLM(path, mesh="colocated=2", enable_prefix_caching=False, **CHUNKED, warmup=False) as llm:
        runner = llm.engine.decode_runner
        extend = runner.extend
        running = llm.submit(Request(llm.new_request_id(), [5, 6, 7], _greedy(200)))
        seen: list[int] = []        # the running stream's tokens when each chunk starts

        def record(tokens, starts, *args):
            if tokens.shape[1] == 256:
                seen.append(len(running.output_ids))
            return extend(tokens, starts, *args)

        while len(running.output_ids) < 2:
            threading.Event().wait(0.01)
        runner.extend = record
        prompt = np.random.default_rng(2).integers(3, 256, size=1200).tolist()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(4))[0]
        runner.extend = extend
        assert out.token_ids == hf_greedy(hf_model, prompt, 4)
        assert len(seen) == 5           # 1,200 tokens: 4 chunks and a rest in the 256 bucket
        assert all(b > a for a, b in zip(seen, seen[1:])), seen
        llm.abort(running.request_id, "done")
        assert_all_pages_free(llm)


@pytest.mark.slow
def test_a_colocated_prompt_aborted_between_chunks_frees_every_page(long_model):
    path, _ = long_model
    with LLM(path, mesh="colocated=2", enable_prefix_caching=False, **CHUNKED, warmup=False) as llm:
        runner = llm.engine.decode_runner
        extend, starts_seen, aborted = runner.extend, [], threading.Event()

        def abort_after_the_second(tokens, starts, *args):
            out = extend(tokens, starts, *args)
            starts_seen.append(int(starts.max()))
            if len(starts_seen) == 2:
                assert llm.abort(request.request_id, "client went away")
                aborted.set()
            return out

        runner.extend = abort_after_the_second
        request = llm.submit(Request(llm.new_request_id(), [7] * 1500, _greedy(4)))
        assert aborted.wait(120)
        assert_all_pages_free(llm)
        assert request.state is State.ABORTED and request.output_ids == []
        assert starts_seen == [0, 256]              # no chunk ran after the abort
        runner.extend = extend
        out = llm.generate(prompt_token_ids=[[7] * 600], sampling_params=_greedy(3))[0]
        assert len(out.token_ids) == 3
        assert_all_pages_free(llm)
