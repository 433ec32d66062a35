"""Warm-up compiles its programs on threads, then runs each once on executables the
threads compiled: the run phase compiles nothing. Long-prompt chunks compile in the
background, and a long prompt waits in its lane until they are ready while short
ones are served. Built-in model, small context."""
from __future__ import annotations

import re
import threading
import time

import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig
from jaxpd.engine.programs.program import ProgramSpec
from jaxpd.engine.compile.warmup import compile_programs, compile_threads, serving_programs
from jaxpd.request import Request, State
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free

@pytest.fixture(scope="module")
def cold_llm():
    llm = LLM(mesh="prefill=1,decode=1", max_model_len=48, max_prefill_batch=2,
              slots_per_shard=2, prefill_chunk_tokens=16, warmup=False)
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_threads_compile_what_the_calls_run(cold_llm):
    by_kind = {}     # the first program of each kind, to keep the test short
    for spec in serving_programs(cold_llm.engine):
        if not spec.background or " chunk:" in spec.describe:
            by_kind.setdefault(re.sub(r"[:\d].*", "", spec.describe), spec)
    assert {"prefill_cached chunk", "prefill_cached", "prefill_cached page take for ",
            "decode step", "the penalty context update", "page insert for "} <= set(by_kind)
    specs = list(by_kind.values())
    messages = []
    with XlaCompiles() as compiled:
        compile_programs(specs, messages.append, threads=2)
    assert compiled.count >= len(specs)
    assert [int(re.match(r"compiling (\d+)/(\d+): ", m).group(1)) for m in messages] == \
        list(range(1, len(specs) + 1))
    with XlaCompiles() as run:
        for spec in specs:
            spec.warm()
    assert run.count == 0


def test_a_stop_during_the_compiles_drops_those_not_started():
    built, release = [], threading.Event()

    def build(i):
        built.append(i)
        if i == 1:
            release.wait(30)
        return []

    class Stop(Exception):
        pass

    def progress(message):
        raise Stop(message)

    specs = [ProgramSpec(f"program {i}", lambda: None, lambda i=i: build(i)) for i in range(6)]
    with pytest.raises(Stop, match="compiling 1/6: program 0"):
        compile_programs(specs, progress, threads=1)
    release.set()
    time.sleep(0.2)
    assert built in ([0], [0, 1])       # 1 may have started on the thread; none after


def test_compile_threads_default_and_bounds():
    assert 1 <= compile_threads(EngineConfig(mesh="prefill=1,decode=1")) <= 4
    assert compile_threads(EngineConfig(mesh="prefill=1,decode=1", compile_threads=3)) == 3
    with pytest.raises(ValueError, match="compile_threads must be >= 1"):
        EngineConfig(mesh="prefill=1,decode=1", compile_threads=0)


def test_chunked_prefill_budget_is_one_chunk():
    """Where long prompts are chunked, a prefill batch's default token budget stops at
    the chunk, so no program of many rows of the longest buckets is compiled."""
    config = EngineConfig(mesh="prefill=1,decode=1", max_model_len=8192)
    assert config.max_prefill_tokens == 2048
    assert EngineConfig(mesh="prefill=1,decode=1", max_model_len=8192,
                        prefill_chunk_tokens=4096).max_prefill_tokens == 4096
    assert EngineConfig(mesh="prefill=1,decode=1", max_model_len=8192,
                        max_prefill_tokens=8192).max_prefill_tokens == 8192


@pytest.mark.slow
def test_a_long_prompt_waits_for_its_chunk_programs_short_ones_go(cold_llm):
    cache = cold_llm.engine.prefill_cache
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    cache.chunks_ready = lambda: False          # as while they compile after warm-up
    try:
        long = cold_llm.submit(Request(cold_llm.new_request_id(), [7] * 40, greedy))
        short = cold_llm.submit(Request(cold_llm.new_request_id(), [5] * 8, greedy))
        deadline = time.monotonic() + 300
        while short.state != State.FINISHED:
            assert time.monotonic() < deadline, short.state
            time.sleep(0.02)
        assert long.state == State.WAITING
    finally:
        del cache.chunks_ready
    deadline = time.monotonic() + 300
    while long.state != State.FINISHED:
        assert time.monotonic() < deadline, long.state
        time.sleep(0.02)
    assert len(long.output_ids) == 2
    assert_all_pages_free(cold_llm)
