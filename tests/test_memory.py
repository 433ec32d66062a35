"""What an engine holds and gives back: starting and shutting down `LLM()` again and
again in one process keeps its resident set where the first cycle left it."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CYCLES = 3
GROWTH_BYTES = 300 << 20

# Each cycle at the library's defaults: the built-in model, mesh "auto", warm-up on and
# kept executables on (the first cycle keeps them, the others load them), the default
# KV budget; RSS is read after `shutdown` and a full collection.
_CYCLE = f"""
import gc, json, logging, weakref
logging.basicConfig(level=logging.INFO)
from jaxpd import LLM, SamplingParams, host_memory
for cycle in range({CYCLES}):
    llm = LLM()
    started = host_memory.rss_bytes()
    out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8, temperature=0))
    assert out[0].token_ids
    llm.shutdown()
    assert llm.engine.decode_runner is None and llm.engine.model.params == {{}}
    engine = weakref.ref(llm.engine)
    gc.disable()
    del llm, out
    assert engine() is None, "the engine sits in a reference cycle after shutdown"
    gc.enable()
    gc.collect()
    print(json.dumps([started, host_memory.rss_bytes()]), flush=True)
"""


@pytest.mark.slow
def test_llm_cycles_in_one_process_give_back_what_each_held(tmp_path):
    # A subprocess, so the resident set is these engines' alone, not the test session's.
    env = {k: v for k, v in os.environ.items() if k != "JAXPD_KEEP_EXECUTABLES"}
    env.update(PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "compiled"))
    out = subprocess.run([sys.executable, "-c", _CYCLE], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == CYCLES
    (first_start, first_after), *later = rows
    for started, after in later:
        assert started - first_start < GROWTH_BYTES, rows
        assert after - first_after < GROWTH_BYTES, rows
    # The plan is logged at start: pools x pages x bytes per page, context, concurrency.
    assert "KV cache: 2 pools x" in out.stderr and "concurrency at full context" in out.stderr


@pytest.mark.slow
def test_shutdown_drops_what_holds_memory_and_keeps_the_counts():
    import gc
    import weakref

    from jaxpd import LLM, SamplingParams

    llm = LLM(mesh="prefill=1,decode=1", max_model_len=64, warmup=False)
    llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    pool = weakref.ref(llm.engine.decode_runner.k_pool)
    counts = llm.stats()
    llm.shutdown()
    llm.shutdown()                                       # twice is harmless
    assert pool() is None                                # gone without a collection
    engine = llm.engine
    assert engine.decode_runner is None and engine.prefill_cache is None
    assert engine.decode_scheduler is not None and engine.is_idle()
    assert llm.stats()["prefill_tokens"] == counts["prefill_tokens"]
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello"], SamplingParams(max_tokens=4))
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del llm, engine
        assert ref() is None                             # no cycle left to collect
    finally:
        gc.enable()
