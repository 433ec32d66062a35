"""The programs an engine serves, listed once (`serving_programs`): warm-up compiles
them before the engine serves (or loads them where they were kept:
`engine.compile.executable_cache`), so steady state compiles nothing (`Engine.counter`
proves it in tests), and `jaxpd.export` lowers the same list for a TPU or GPU."""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import numpy as np

from jaxpd.engine.compile.executable_cache import KeptExecutables
from jaxpd.engine.programs.program import ProgramSpec
from jaxpd.engine.programs.sampler import SamplingArrays
from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.engine.kv.paged_prefill import chunk_widths
from jaxpd.engine.scheduling.buckets import context_widths
from jaxpd.models.hf_io import DTYPES
from jaxpd.sizes import coarse_sizes

_log = logging.getLogger(__name__)


def warm_up(engine, progress: Callable[[str], None],
            spans_processes: bool = False, keep: KeptExecutables | None = None) -> None:
    """Every prefill (batch, length) bucket, every decode (rows, context width),
    every padded insert, take and host-tier offload size, and the penalty context
    update. Runs before the engine's threads start. Programs with a cached prefix are
    among them where the prefix is read in place (`PrefillCache.prefix_in_place`); the
    others, and the decode mesh's extends beside a prefill mesh, compile in the
    background on first demand, and long-prompt chunks at once (both started here,
    once the rest are compiled).

    `engine`: the `Phases` to warm up. XLA compiles a program on one core, so the
    programs compile on `compile_threads` threads (`compile_programs`) and none runs:
    each serving call finds its executable installed in its runner's table, loaded
    where `keep` kept it (`engine.compile.executable_cache`; None: compiled, not kept),
    and so do the background compiles. Only a spec that is not `ahead` runs once here,
    compiling where it runs, and one to `run_once` (the decode thread's programs, on
    padding rows and the null page). A role `spans_processes` runs every program once
    on this thread instead, touching only the null page: its followers compile by
    replaying each dispatch in the leader's order."""
    keep = keep or KeptExecutables(None)
    specs = [s for s in serving_programs(engine) if not s.background]
    if spans_processes:
        for i, spec in enumerate(specs):
            progress(f"compiling {i + 1}/{len(specs)}: {spec.describe}")
            spec.warm()
    else:
        compile_programs(specs, progress, compile_threads(engine.config), keep)
        for spec in specs:
            if not spec.ahead or spec.run_once:
                spec.warm()
        if keep.directory is not None:
            _log.info("warm-up: %d programs loaded from %s, %d compiled (%d of them from "
                      "jax's cache, not kept), %d refused", keep.loaded, keep.directory,
                      keep.compiled, keep.unkept, keep.refused)
            keep.prune()
    if engine.decode_runner is not None:
        jax.block_until_ready(engine.decode_runner.k_pool)
    cached, extended = likely_prefix_shapes(engine)
    if engine.prefill_cache is not None:
        loop = engine.prefill_loop
        engine.prefill_cache.start_background(
            chunk_shapes(loop) if loop is not None and loop.chunk_tokens is not None else [],
            keep)
        engine.prefill_cache.anticipate(cached)
    if engine.decode_loop is not None and engine.decode_loop.extend is not None and \
            engine.decode_loop.extend.lazy:
        engine.decode_runner.start_background_extend(keep)
        engine.decode_runner.anticipate_extend(extended)


def compile_threads(config) -> int:
    """`config.compile_threads`, or the host's CPU count, at most 4."""
    return config.compile_threads or min(4, os.cpu_count() or 1)


def compile_programs(specs: list[ProgramSpec], progress: Callable[[str], None],
                     threads: int, keep: KeptExecutables | None = None) -> None:
    """Compile (or load) every program of `specs` on `threads` threads without running
    any.

    Each is compiled for the arguments its serving call passes (`Program.args`: the
    runner's own arrays, host inputs as numpy) and installed where the call runs it
    (`KeptExecutables.install`: loaded from `keep` when kept there, else compiled and
    kept), and noted in its runner's `CompileCounter` as the call would note it (a spec
    that is not `ahead` compiles when it runs).
    Lowering holds the GIL, XLA's compile does not, so the threads overlap compiles.
    Progress is reported in list order as each finishes. A failure, or an exception
    from `progress`, raises once reached in that order, and the compiles not yet
    started are dropped."""
    keep = keep or KeptExecutables(None)

    def compile_one(spec: ProgramSpec) -> None:
        for program in spec.build() if spec.ahead else ():
            keep.install(program)
            if program.note is not None:
                program.note()

    pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxpd-compile")
    try:
        for i, (spec, _) in enumerate(zip(specs, pool.map(compile_one, specs))):
            progress(f"compiling {i + 1}/{len(specs)}: {spec.describe}")
    finally:
        # A failure, or `progress` raising to stop the start-up (the launcher on a
        # signal), drops the compiles not yet started instead of waiting for them.
        pool.shutdown(wait=False, cancel_futures=True)


def serving_programs(engine) -> list[ProgramSpec]:
    """Every program `engine` can run while serving, in warm-up's order: prefill
    buckets (or the prefill cache's programs and its page takes) and long-prompt
    chunks of each prefill loop, then the decode steps, the penalty context update,
    page inserts (and takes, elastic), and the decode mesh's prefills with context.
    Sampling options are per-row arrays under `lax.cond` inside each program, so every
    sampler variant is part of each prefill and decode program, not one of its own."""
    specs: list[ProgramSpec] = []
    for loop in (engine.prefill_loop, engine.local_loop):
        if loop is not None:
            specs += _prefill(loop)
    if engine.decode_loop is not None:
        specs += _decode(engine)
        if engine.decode_loop.extend is not None:
            specs += _extend(engine)
    return specs


def _prefill(loop) -> list[ProgramSpec]:
    runner = loop.runner
    shapes = _batch_shapes(loop)
    specs = _chunks(loop) if loop.chunk_tokens is not None else []
    if loop.cache is not None:
        return specs + _prefill_cached(loop, shapes)
    for b, t in shapes:
        args = (np.zeros((b, t), np.int32), np.ones(b, np.int32), SamplingArrays.empty(b))
        describe = f"{runner.name}: batch {b} x {t} tokens"
        if loop.uses_layerwise(t):
            specs.append(ProgramSpec(
                describe + ", layer-wise",
                lambda args=args: jax.block_until_ready(
                    runner.run_layerwise(*args, loop.layerwise, [])),
                lambda args=args: runner.layerwise_programs(*args, loop.layerwise),
                # lowered with each group's kinds bound: other functions than it runs
                ahead=False))
        else:
            specs.append(ProgramSpec(describe, lambda args=args: runner.run(*args),
                                     lambda args=args: [runner.run_program(*args)]))
        specs.append(_takes(loop, b, t))
    return specs


def _takes(loop, b: int, t: int) -> ProgramSpec:
    """The page takes of a b x t batch prefilled whole (`PrefillRunner.take_pages`, one
    per padded page count a row can send; of each layer group's K/V when layer-wise).
    A role spanning processes cuts its pages in a collective its followers replay
    after the batch's prefill, so it takes them where they run (`warm` does nothing)."""
    runner, cfg = loop.runner, loop.runner.cfg
    sizes = (sorted({stop - start for start, stop in loop.layerwise})
             if loop.uses_layerwise(t) else [cfg.num_layers])
    shapes = [(size, b, t, cfg.num_kv_heads, cfg.head_dim) for size in sizes]
    return ProgramSpec(f"{runner.name}: page takes of a batch of {b} x {t} tokens",
                       lambda: None,
                       lambda: [p for shape in shapes for p in runner.take_programs(shape)])


def chunk_shapes(loop) -> list[tuple[int, int]]:
    """(new tokens, prefix pages) of a long prompt's chunk programs
    (`PrefillLoop._chunk_step`): the first, of a whole chunk without a prefix, and
    each new-token bucket after each prefix width."""
    cache, chunk = loop.cache, loop.chunk_tokens
    widths = chunk_widths(chunk // loop.page_size, cache.max_pages)
    return [(chunk, 0)] + [(t, w) for t in cache.coarse_new_buckets(chunk,
                                                                    loop.scheduler.buckets)
                           for w in widths]


def _chunks(loop) -> list[ProgramSpec]:
    """The chunk programs (`chunk_shapes`). Only prompts longer than the largest
    bucket run them, so they compile in the background after warm-up
    (`PrefillCache.start_background`) while shorter prompts are served; a long
    prompt waits in its lane until all are compiled (`PrefillLoop.run_once`)."""
    cache, page_size = loop.cache, loop.page_size
    shapes = chunk_shapes(loop)
    context = np.zeros((1, cache.context_width()), np.int32)
    specs = []
    for t, w in shapes:
        args = (np.zeros((1, t), np.int32), 0, 1, np.zeros((1, w), np.int32),
                np.zeros((1, pages_for(t, page_size)), np.int32), SamplingArrays.empty(1),
                context)
        specs.append(ProgramSpec(f"{cache.name} chunk: {t} tokens, {w} pages of prefix",
                                 lambda args=args: cache.run_chunk(*args),
                                 lambda args=args: [cache.chunk_program(*args)],
                                 background=True))
    return specs


def _prefill_cached(loop, shapes) -> list[ProgramSpec]:
    """A cached prefill batch in bucket `t` runs one of `PrefillCache.shapes(t)` (new
    tokens, prefix pages) (`PrefillLoop._run_cached`). Warm-up compiles those without a
    prefix (what a batch computes when nothing it holds pays, as with the cache off),
    and with `prefix_in_place` every one (one width for all: no more programs than
    without a prefix); else those with one compile in the background on first demand
    (`background`). Padding rows write the null page."""
    cache, page_size = loop.cache, loop.page_size
    specs = []
    for b, t, w in _cached_shapes(loop, shapes):
        args = (np.zeros((b, t), np.int32), np.zeros(b, np.int32), np.ones(b, np.int32),
                np.zeros((b, w), np.int32), np.zeros((b, pages_for(t, page_size)), np.int32),
                SamplingArrays.empty(b))
        specs.append(ProgramSpec(f"{cache.name}: batch {b} x {t} tokens, {w} pages of prefix",
                                 lambda args=args: cache.run(*args),
                                 lambda args=args: [cache.run_program(*args)],
                                 background=w > 0 and not cache.prefix_in_place))
    for m in cache.take_sizes():
        specs.append(ProgramSpec(f"{cache.name} page take for {m} pages",
                                 lambda m=m: cache.take([0] * m),
                                 lambda m=m: [cache.take_program(m)]))
    # Its host tier (`attach_host`) copies evicted pages out and restores them in.
    for m in cache.host_sizes():
        specs.append(ProgramSpec(f"{cache.name} page offload to the host tier for {m} pages",
                                 lambda m=m: jax.block_until_ready(cache.offload(0, [0] * m)),
                                 lambda m=m: [cache.offload_program(m)]))
        specs.append(ProgramSpec(f"{cache.name} page restore for {m} pages",
                                 lambda m=m: cache.insert(0, [0] * m, *(2 * (jax.device_put(
                                     np.zeros(cache.pages_shape(m), cache.k_pool.dtype),
                                     cache.shard_sharding(0)),))),
                                 lambda m=m: [cache.insert_program(m)]))
    return specs


def _cached_shapes(loop, shapes) -> list[tuple[int, int, int]]:
    """(rows, new tokens, prefix pages) of every program of the prefill cache for
    these (padded batch, bucket) `shapes`."""
    return sorted({(b, new, w) for b, t in shapes
                   for new, w in loop.cache.shapes(t, loop.scheduler.buckets)})


def _batch_shapes(loop) -> list[tuple[int, int]]:
    """(padded batch, bucket) of every prefill batch `loop` can form."""
    sched = loop.scheduler
    return sorted({(sched.padded_batch(b, t), t) for t in sched.buckets
                   for b in sched.batch_sizes})


def _decode(engine) -> list[ProgramSpec]:
    cfg, runner = engine.config, engine.decode_runner
    widths = context_widths(cfg.decode_context_step, cfg.pages_per_slot,
                            engine.decode_loop.by_length)
    specs = []
    for b in engine.decode_loop.batch_sizes:
        for w in widths:
            n = b * cfg.mesh.decode_dp
            args = (np.zeros(n, np.int32), np.ones(n, bool), np.zeros(n, np.int32),
                    np.zeros((n, w), np.int32), SamplingArrays.empty(n),
                    np.full(n, cfg.slots_per_shard, np.int32))     # padding rows only
            specs.append(ProgramSpec(f"decode step: {b} rows a shard, {w} pages of context",
                                     lambda args=args: jax.block_until_ready(runner.step(*args)),
                                     lambda args=args: [runner.step_program(*args)],
                                     run_once=True))
    # zeros: read only after an insert rewrites them
    specs.append(ProgramSpec("the penalty context update",
                             lambda: runner.set_penalties(0, [], []),
                             lambda: [runner.penalties_program()], run_once=True))
    model = engine.model.cfg
    # A handoff carries its pages padded to `coarse_ceil` of their count: one insert
    # program per padded count.
    for m in coarse_sizes(cfg.pages_per_slot):
        def warm(m=m):
            shape = (model.num_layers, m, cfg.page_size, model.num_kv_heads, model.head_dim)
            # numpy zeros: put, not computed, so running it compiles only the insert
            pages = jax.device_put(np.zeros(shape, DTYPES[cfg.dtype]), runner.shard_sharding(0))
            runner.insert(0, [0] * m, pages, pages)
        specs.append(ProgramSpec(f"page insert for {m} pages", warm,
                                 lambda m=m: [runner.insert_program(m)], run_once=True))
    if engine.host_tier is not None:
        # Evicted pages are copied off the pool for the host tier (`engine.kv.host_tier`);
        # restoring them runs the inserts above.
        for m in engine.host_tier.sizes():
            specs.append(ProgramSpec(f"page offload to the host tier for {m} pages",
                                     lambda m=m: jax.block_until_ready(runner.offload(0, [0] * m)),
                                     lambda m=m: [runner.offload_program(m)], run_once=True))
    if cfg.mesh.elastic or cfg.migrate_on_drain:
        # A re-split or a migration cuts each decoding request's pages out of the pool
        # (`engine.elastic`, `engine.kv.migration`).
        for m in coarse_sizes(cfg.pages_per_slot):
            specs.append(ProgramSpec(f"page take for {m} pages",
                                     lambda m=m: runner.take(0, [0] * m),
                                     lambda m=m: [runner.take_program(m)], run_once=True))
    return specs


def _extend(engine) -> list[ProgramSpec]:
    """Prefill-with-context programs: each length bucket, each batch size that fits the
    token budget, and each width of cached prefix a row computing in that bucket can
    have (none included; with a prefix, compiled on demand when the loop is `lazy`)."""
    loop, page_size, runner = engine.decode_loop.extend, engine.config.page_size, \
        engine.decode_runner
    specs = []
    for rows, t, w in _extend_shapes(loop):
        args = (np.zeros((rows, t), np.int32), np.zeros(rows, np.int32), np.ones(rows, np.int32),
                np.zeros((rows, w), np.int32),
                np.zeros((rows, pages_for(t, page_size)), np.int32),
                np.zeros(rows, np.int32), SamplingArrays.empty(rows))
        specs.append(ProgramSpec(
            f"prefill with context: {rows} x {t} tokens, {w} pages of prefix",
            lambda args=args: runner.extend(*args), lambda args=args: [runner.extend_program(*args)],
            background=loop.lazy and w > 0))
    return specs


def _extend_shapes(loop) -> list[tuple[int, int, int]]:
    """(rows, new tokens, prefix pages) of every program of the extend loop `loop`."""
    shapes = set()
    for t in loop.warm_buckets:
        shapes |= {(rows, t, w) for rows in loop.rows_for(t)
                   for w in loop.widths(loop.max_prefix_pages(t))}
    return sorted(shapes)


# The most programs with a prefix queued after warm-up, per runner (`likely_prefix_shapes`).
LIKELY_PROGRAMS = 16


def likely_prefix_shapes(engine) -> tuple[list[tuple[int, int, int]],
                                          list[tuple[int, int, int]]]:
    """The programs with a cached prefix that warm-up leaves to the background and a
    workload is likely to reach, as (rows, new tokens, prefix pages) of the prefill
    cache and of the decode mesh's extend loop, in the order it reaches them. A
    conversation's prefix grows turn by turn, so the narrow prefixes come first and
    the wide ones rarely: those of at most a quarter of `max_model_len` are likely,
    the rest compile on demand (an extend loop reading its prefix in place has one
    width, the slot's, for every prefix: all of its are likely). Within a width, the
    prefill cache's come by fewer rows
    (batches grow with the load), then fewer new tokens; the extend loop's by fewer new
    tokens, with every row count together (a request goes there only once all of its
    row counts are compiled: `ExtendLoop.ready_for`). At most `LIKELY_PROGRAMS` of
    each: every one takes a core while it compiles and holds its executable's memory
    after, beside a serving engine."""
    config = engine.config

    def likely(shape):
        return 0 < shape[2] * config.page_size <= config.max_model_len // 4

    cached, extended = [], []
    loop = engine.prefill_loop
    # (None of the prefill cache's when it reads its prefix in place: warm-up compiled
    # them all.)
    if loop is not None and loop.cache is not None and loop.cache.reuse and \
            not loop.cache.prefix_in_place:
        cached = sorted(filter(likely, _cached_shapes(loop, _batch_shapes(loop))),
                        key=lambda s: (s[2], s[0], s[1]))
    extend = engine.decode_loop.extend if engine.decode_loop is not None else None
    # (None of them when no request is routed there: `expected_below` 0.)
    if extend is not None and extend.lazy and extend.expected_below:
        extended = sorted((s for s in _extend_shapes(extend)
                           if s[2] and (extend.prefix_in_place or likely(s))),
                          key=lambda s: (s[2], s[1], s[0]))
    return cached[:LIKELY_PROGRAMS], extended[:LIKELY_PROGRAMS]
