"""A prefix cache that pays from the first repeat: at the library's defaults (warm-up
on), six four-turn chats sharing a 200-token system prompt compute well under half the
prompt tokens with the cache on, with the cache-off greedy tokens, and nothing
compiles while they are served but what the decode mesh compiles in the background."""
import numpy as np
import pytest

from jaxpd import LLM
from jaxpd.engine.compile.warmup import likely_prefix_shapes, serving_programs
from jaxpd.models import native_attention
from tests.engine_fixtures import XlaCompiles
from tests.support.prefix_chats import check_pool, greedy

SYSTEM_LEN, CHATS, TURNS, ANSWER = 200, 6, 4, 6


def six_chats(seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, then each chat's user turns (growing, as in
    `prefix_chats.conversation`)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 256, SYSTEM_LEN).tolist()
    return system, [[rng.integers(3, 256, 5 + 9 * t).tolist() for t in range(TURNS)]
                    for _ in range(CHATS)]


def serve_chats(llm: LLM, system: list[int], chats: list[list[list[int]]]) -> list:
    """Each turn of every chat in one `generate` call, as a user's script would: the
    prompt is the chat so far. Returns every answer, turn by turn."""
    convs = [list(system) for _ in chats]
    answers = []
    for t in range(TURNS):
        for conv, users in zip(convs, chats):
            conv += users[t]
        outs = llm.generate(prompt_token_ids=convs, sampling_params=greedy(ANSWER))
        for conv, out in zip(convs, outs):
            conv += out.token_ids
        answers.append([out.token_ids for out in outs])
    return answers


def _serving_counts(llm: LLM) -> dict:
    """The engine's compiled shapes but the background compilers' (the decode mesh's
    prefills with context beside a prefill mesh compile there, routed to only once
    they ran)."""
    return {k: v for k, v in llm.engine.counter.counts().items()
            if not k.endswith("_background")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    pytest.param("prefill=2,decode=2", marks=pytest.mark.matrix), "prefill=1,decode=1"])
def test_multiturn_chats_compute_under_half_from_the_first_repeat(hf_models, mesh):
    # Head dim 32: the prefill mesh's prefix core is native (AVX-512) and reads any
    # prefix in place, so warm-up compiles every program a prefix hit runs.
    if not native_attention.prefill_available(32):
        pytest.skip("the native prefix kernel needs AVX-512 here; the reference "
                    "compiles its programs with a prefix in the background")
    path, _ = hf_models("llama_gqa", hidden_size=256)
    system, chats = six_chats()
    computed, answers = {}, {}
    for cache in (False, True):
        with LLM(path, mesh=mesh, max_model_len=320, slots_per_shard=8,
                 enable_prefix_caching=cache) as llm:
            if cache:
                assert llm.engine.prefill_cache.prefix_in_place
            counts, before = _serving_counts(llm), llm.stats()
            with XlaCompiles(on_request_threads=True) as xla:
                answers[cache] = serve_chats(llm, system, chats)
            after = llm.stats()
            delta = {k: after[k] - before[k] for k in (
                "prefill_computed_tokens", "prefill_tokens", "prefill_cache_cold_batches",
                "extend_cold_requests", "prefill_cache_hit_tokens", "prefix_hit_tokens")}
            computed[cache] = delta["prefill_computed_tokens"]
            assert xla.count == 0
            assert _serving_counts(llm) == counts
            assert delta["prefill_cache_cold_batches"] == delta["extend_cold_requests"] == 0
            assert delta["prefill_tokens"] == delta["prefill_computed_tokens"]
            if cache:
                assert delta["prefill_cache_hit_tokens"] + delta["prefix_hit_tokens"] > 0
            check_pool(llm)
    prompts = sum(SYSTEM_LEN + sum(5 + 9 * i for i in range(t + 1)) + ANSWER * t
                  for t in range(TURNS)) * CHATS
    assert computed[False] == prompts
    assert computed[True] <= 0.45 * computed[False], computed
    assert answers[True] == answers[False]


def test_the_prefill_cache_warms_every_prefix_program_with_no_more_programs():
    """Built-in model (head dim 32): with the prefix read in place, the prefill cache's
    programs are one per (rows, new tokens) at one width, all warmed up, as many as the
    cache-off pool's; nothing of its own is left to the background."""
    if not native_attention.prefill_available(32):
        pytest.skip("the native prefix kernel needs AVX-512 here")
    programs = {}
    for cache in (False, True):
        with LLM(mesh="prefill=1,decode=1", max_model_len=256, slots_per_shard=2,
                 enable_prefix_caching=cache, warmup=False) as llm:
            specs = [s for s in serving_programs(llm.engine)
                     if s.describe.startswith("prefill_cached:")]
            warmed = [s for s in specs if not s.background]
            programs[cache] = len(warmed)
            if cache:
                assert warmed == specs
                max_pages = llm.engine.prefill_cache.max_pages
                assert all(s.describe.endswith(f" {max_pages} pages of prefix") for s in specs)
                assert likely_prefix_shapes(llm.engine)[0] == []
            else:    # (a pool without reuse never runs those with a prefix it lists)
                assert all(s.describe.endswith(" 0 pages of prefix") for s in warmed)
    assert programs[True] == programs[False]
