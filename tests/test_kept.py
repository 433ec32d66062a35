"""Kept executables (`engine.compile.executable_cache`): a program compiled once is
loaded on the next start without tracing or compiling, runs where its serving call runs
it, and is refused (and compiled again) when its file is damaged or anything in its key
changed."""
from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd import LLM, SamplingParams
from jaxpd.config import EngineConfig
from jaxpd.engine.compile import executable_cache
from jaxpd.engine.compile.executable_cache import KeptExecutables, context_digest
from jaxpd.engine.programs.program import Program
from jaxpd.engine.compile.warmup import serving_programs
from jaxpd.sharding.compat import shard_map
from tests.engine_fixtures import JaxEvents, XlaCompiles
from tests.hf_fixtures import hf_greedy


class Events(JaxEvents):
    """Counts jax's traces and lowerings to MLIR (`compiles`: its XLA compiles instead)
    while entered, on threads whose name starts with `on_threads`."""
    TRACES = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def __init__(self, on_threads: str = "", compiles: bool = False):
        self.count, self.prefix = 0, on_threads
        self.events = (XlaCompiles.EVENT,) if compiles else self.TRACES

    def __call__(self, event, duration, **kwargs):
        if event in self.events and threading.current_thread().name.startswith(self.prefix):
            self.count += 1


def _pool_program(width: int) -> tuple[Program, list]:
    """A decode-like program on a 2 x 2 mesh of devices 4..7 in a shuffled order: a pool
    split over dp, donated and updated in place, host rows placed by the shard_map.
    `width`: of the pool's pages, one per test, so that each compiles its own program
    fresh (not from the session's persistent cache: only a fresh compile is kept)."""
    devices = jax.devices()
    mesh = Mesh(np.array([devices[6], devices[4], devices[7], devices[5]]).reshape(2, 2),
                ("dp", "tp"))
    pool_sharding = NamedSharding(mesh, P(None, "dp"))

    def body(weights, pool, rows):
        return (rows * 2 + weights.sum().astype(jnp.int32),
                pool.at[:, 0].add(rows[0].astype(pool.dtype)))

    fn = jax.jit(shard_map(body, mesh=mesh, axis_names={"dp"},
                           in_specs=(P(), P(None, "dp"), P("dp")),
                           out_specs=(P("dp"), P(None, "dp"))), donate_argnums=(1,))
    weights = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P()))
    pool = jax.device_put(np.zeros((2, 8, width), np.float32), pool_sharding)
    rows = np.array([1, 2, 3, 4], np.int32)
    installed = []
    return Program("pool_update", fn, (weights, pool, rows),
                   host_sharding=NamedSharding(mesh, P("dp")), install=installed.append), \
        installed


def _run(program: Program, executable):
    weights, pool, rows = program.args
    fresh = jax.device_put(np.zeros(pool.shape, pool.dtype), pool.sharding)
    out, updated = executable(weights, fresh, rows)
    assert fresh.is_deleted()                     # donated: updated in place
    return np.asarray(out), np.asarray(updated)


def test_a_kept_program_loads_without_tracing_and_runs_the_same(tmp_path):
    program, installed = _pool_program(3)
    first = KeptExecutables(str(tmp_path), "context")
    first.install(program)
    assert (first.loaded, first.compiled, first.refused) == (0, 1, 0)
    files = sorted(tmp_path.glob(f"*{executable_cache.SUFFIX}"))      # by its key, by its text's
    assert [f.name.split("-")[0] for f in files] == ["lowered", "pool_update"]
    second = KeptExecutables(str(tmp_path), "context")
    with XlaCompiles() as compiles, Events() as traces:
        second.install(program)
    assert (second.loaded, second.compiled, compiles.count, traces.count) == (1, 0, 0, 0)
    compiled, loaded = installed
    expected = _run(program, compiled)
    got = _run(program, loaded)
    assert all(np.array_equal(a, b) for a, b in zip(expected, got))
    assert expected[1][:, 0].tolist() == [[1, 1, 1], [1, 1, 1]]   # each shard's row 0
    assert second.prune(max_bytes=0) == 2 and not any(f.exists() for f in files)


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "other key"])
def test_a_damaged_kept_file_is_refused_with_a_warning(tmp_path, caplog, damage):
    """Its key's file damaged: refused, loaded by its lowered text and kept again under
    its key. Both damaged: refused, compiled (here jax's own cache has it: served, not
    kept) and it runs the same."""
    width = {"truncated": 4, "corrupt": 5, "other key": 6}[damage]
    program, installed = _pool_program(width)
    KeptExecutables(str(tmp_path), "context").install(program)
    by_key, = tmp_path.glob(f"pool_update-*{executable_cache.SUFFIX}")
    by_text, = tmp_path.glob(f"lowered-*{executable_cache.SUFFIX}")
    for path in (by_key, by_text):
        data = path.read_bytes()
        if damage == "truncated":
            data = data[:len(data) // 2]
        elif damage == "corrupt":
            data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
        else:     # another program's file under this name: its header names another key
            start = data.index(b'"key": "') + 8
            data = data[:start] + b"0" * 64 + data[start + 64:]
        path.write_bytes(data)
        keep = KeptExecutables(str(tmp_path), "context")
        with caplog.at_level(logging.WARNING, logger="jaxpd.engine.compile.executable_cache"):
            keep.install(program)
        assert f"{path.name} refused" in caplog.text
        if path is by_key:
            assert (keep.loaded, keep.compiled, keep.refused) == (1, 0, 1)
            again = KeptExecutables(str(tmp_path), "context")      # kept whole again
            again.install(program)
            assert (again.loaded, again.refused) == (1, 0)
            by_key.write_bytes(data)
        else:     # jax's cache holds this program since its first compile
            assert (keep.loaded, keep.compiled, keep.refused, keep.unkept) == (0, 1, 2, 1)
    expected = _run(program, installed[0])
    assert all(np.array_equal(a, b) for a, b in zip(expected, _run(program, installed[-1])))


def test_a_change_of_config_or_source_misses(tmp_path, monkeypatch):
    program, _ = _pool_program(7)
    base = EngineConfig(mesh="prefill=1,decode=1", page_size=16)
    contexts = {"base": context_digest("fp", base),
                "page_size": context_digest("fp", EngineConfig(mesh="prefill=1,decode=1",
                                                               page_size=8)),
                "dtype": context_digest("fp", EngineConfig(mesh="prefill=1,decode=1",
                                                           page_size=16, dtype="bfloat16")),
                "model": context_digest("other fp", base)}
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited source")
    contexts["source"] = context_digest("fp", base)
    assert len(set(contexts.values())) == len(contexts)
    KeptExecutables(str(tmp_path), contexts["base"]).install(program)
    for name, context in contexts.items():
        keep = KeptExecutables(str(tmp_path), context)
        keep.install(program)
        # Another context misses its key, so lowers the program; it lowers the same, so
        # it is loaded by its text's key, and kept under its own.
        assert (keep.loaded, keep.refused, keep.lowered) == (1, 0, int(name != "base")), name
    assert len(list(tmp_path.glob(f"pool_update-*{executable_cache.SUFFIX}"))) == len(contexts)


def test_source_digest_covers_the_python_and_the_native_kernels():
    executable_cache.source_digest.cache_clear()
    digest = executable_cache.source_digest()
    assert len(digest) == 64 and executable_cache.source_digest() == digest


_ENGINE = dict(mesh="prefill=1,decode=1", max_model_len=32, max_prefill_batch=1,
               slots_per_shard=1, prefill_chunk_tokens=16, page_size=8)


@pytest.mark.slow
def test_a_second_engine_loads_every_program_and_serves_the_same_tokens(hf_models,
                                                                         monkeypatch):
    """Two engines of one config in one compilation cache (the test session's): the
    first compiles its programs and keeps them; the second's warm-up loads every one
    without tracing or compiling on its threads; its requests compile nothing (their
    calls run the loaded executables) and give transformers' greedy tokens, as the
    first's do. A model of this test's own (one layer, its own vocabulary), so that
    no other test's compile of the same programs is in jax's cache before it."""
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")     # off for the rest of the suite
    path, hf_model = hf_models("llama_gqa", vocab_size=232, num_layers=1)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13], list(range(3, 15))]
    expected = [hf_greedy(hf_model, p, 6) for p in prompts]
    with LLM(path, warmup=True, **_ENGINE) as first:
        ahead = sum(not spec.background for spec in serving_programs(first.engine))
        assert first.engine.kept.directory is not None and first.engine.kept.compiled >= ahead
        assert [o.token_ids for o in first.generate(prompt_token_ids=prompts,
                                                    sampling_params=greedy)] == expected
    with Events("jaxpd-compile", compiles=True) as compiles, \
            Events("jaxpd-compile") as traces:
        second = LLM(path, warmup=True, **_ENGINE)
    with second:
        keep, engine = second.engine.kept, second.engine
        installed = len(engine.decode_runner.executables) + \
            len(engine.prefill_cache.executables)
        assert (keep.lowered, keep.compiled, keep.refused) == (0, 0, 0)
        assert keep.loaded >= installed == ahead
        assert (compiles.count, traces.count) == (0, 0)
        with XlaCompiles(on_request_threads=True) as serving:
            got = [o.token_ids for o in second.generate(prompt_token_ids=prompts,
                                                        sampling_params=greedy)]
        assert serving.count == 0 and got == expected


def test_keeping_follows_the_compilation_cache_and_its_switch(monkeypatch):
    from jaxpd import xla_cache
    cache = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")
    assert xla_cache.kept_dir() == (os.path.join(cache, xla_cache.KEPT) if cache else None)
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "0")
    assert xla_cache.kept_dir() is None
