"""An elastic split in one process (`mesh="elastic=N"`, `LLM.resplit`): devices move
between the prefill and decode meshes under load, every request keeps its greedy
tokens, decoding requests keep their KV (moved, not recomputed), no page leaks."""
import re
import time

import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig
from jaxpd.sharding.spec import MeshSpec, parse_mesh_spec
from tests.engine_fixtures import (assert_all_pages_free, build_hf_model, mixed_prompts,
                                   reference)

NUM_REQUESTS = 12
MAX_MODEL_LEN = 160


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    hf_model = build_hf_model("llama_gqa", path)
    prompts = mixed_prompts(NUM_REQUESTS, 256, seed=3)
    # Long answers: requests are still decoding when the split moves.
    max_tokens = [min(MAX_MODEL_LEN - 10 - len(p), 36 + (7 * i) % 30)
                  for i, p in enumerate(prompts)]
    return path, prompts, max_tokens, reference(hf_model, prompts, max_tokens)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _wait_decoding(llm, requests, at_least: int) -> None:
    """Until `at_least` of `requests` have a few tokens and are not finished."""
    deadline = time.monotonic() + 60
    while sum(len(r.output_ids) >= 3 and not r.is_final for r in requests) < at_least:
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.002)


def test_elastic_specs_parse_and_bad_ones_are_refused():
    assert parse_mesh_spec("elastic=8") == MeshSpec(4, 4, elastic=8)
    spec = parse_mesh_spec("elastic=8,prefill=2")
    assert (spec.prefill_tp, spec.decode_dp, str(spec)) == (2, 6, "elastic=8,prefill=2")
    assert parse_mesh_spec(str(spec)) == spec and spec.num_devices == 8
    assert spec.split(5) == MeshSpec(5, 3, elastic=8)
    for bad, says in [("elastic=8,prefill=8", "prefill must be in [1, 7]"),
                      ("elastic=1", "elastic=N (N >= 2)"),
                      ("elastic=8,decode=2", "optional prefill"),
                      ("elastic=8,colocated=8", "optional prefill")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_mesh_spec(bad)
    with pytest.raises(ValueError, match="not elastic"):
        parse_mesh_spec("prefill=4,decode=4").split(2)
    # What a re-split does not move yet is refused up front, naming the field.
    for field, value in [("enable_prefix_caching", True), ("kv_transfer_dtype", "int8"),
                         ("local_prefill_below", 32)]:
        with pytest.raises(ValueError, match=f"{field} is not supported with mesh elastic=8"):
            EngineConfig(mesh="elastic=8", **{field: value})


@pytest.mark.slow
def test_resplit_under_load_keeps_tokens_and_moves_kv(tiny):
    path, prompts, max_tokens, expected = tiny
    with LLM(path, mesh="elastic=8", max_model_len=MAX_MODEL_LEN, slots_per_shard=4,
             warmup=False) as llm:
        assert llm.stats()["prefill_devices"] == 4 and llm.stats()["decode_devices"] == 4
        half = NUM_REQUESTS // 2
        requests = [llm.submit(llm.make_request(prompt_token_ids=p, sampling_params=_greedy(n)))
                    for p, n in zip(prompts[:half], max_tokens[:half])]
        assert llm.prepare_resplit(2) >= 0    # built beside, while serving
        _wait_decoding(llm, requests, 3)
        # The second half arrives as the split moves: queued, prefilling or handed off.
        requests += [llm.submit(llm.make_request(prompt_token_ids=p, sampling_params=_greedy(n)))
                     for p, n in zip(prompts[half:], max_tokens[half:])]
        to_decode = llm.resplit(2)
        assert (str(to_decode.old), str(to_decode.new)) == ("elastic=8,prefill=4",
                                                             "elastic=8,prefill=2")
        llm.prepare_resplit(6)
        _wait_decoding(llm, requests, 3)
        to_prefill = llm.resplit(6)
        assert llm.resplit(6).moved_requests == 0          # already there: nothing moves
        outs = [llm._wait(r) for r in requests]
        for out, exp in zip(outs, expected):
            assert out.finish_reason == "length" and out.token_ids == exp
        assert_all_pages_free(llm)
        stats = llm.stats()
        moved = to_decode.moved_requests + to_prefill.moved_requests
        assert to_decode.moved_requests >= 3 and to_prefill.moved_requests >= 3
        assert stats["resplits"] == 2 and stats["resplit_moved_requests"] == moved
        # Moved, not recomputed: every prompt token was prefilled once, and each moved
        # request crossed meshes once more than its prefill's handoff.
        assert stats["prefill_tokens"] == sum(len(p) for p in prompts)
        assert stats["transfers"] == NUM_REQUESTS + moved
        assert stats["transfer_failures"] == 0 and stats["aborted"] == 0
        assert (stats["mesh"], stats["prefill_devices"], stats["decode_devices"]) == (
            "elastic=8,prefill=6", 6, 2)
        assert stats["slots_total"] == 2 * 4 and stats["finished"] == NUM_REQUESTS
        for bad in (0, 8):
            with pytest.raises(ValueError, match="prefill must be in"):
                llm.resplit(bad)

        # Requests aborted as the split moves end aborted; the others are unharmed.
        again = [llm.submit(llm.make_request(prompt_token_ids=p, sampling_params=_greedy(n)))
                 for p, n in zip(prompts[:6], max_tokens[:6])]
        _wait_decoding(llm, again, 3)
        cancelled = [r for r in again if not r.is_final][:2]
        for r in cancelled:
            llm.abort(r.request_id)
        llm.resplit(3)
        for r, exp in zip(again, expected):
            out = llm._wait(r)
            if r in cancelled:
                assert out.finish_reason == "abort"
            else:
                assert out.finish_reason == "length" and out.token_ids == exp
        assert_all_pages_free(llm)
        assert llm.stats()["prefill_tokens"] == sum(len(p) for p in prompts + prompts[:6])
        # A split prepared and never moved to goes with the engine at shutdown.
        llm.prepare_resplit(4)


@pytest.mark.slow
def test_resplit_needs_an_elastic_mesh(tiny):
    with LLM(tiny[0], mesh="prefill=1,decode=1", max_model_len=MAX_MODEL_LEN, warmup=False) as llm:
        with pytest.raises(ValueError, match="needs an elastic mesh"):
            llm.resplit(1)
