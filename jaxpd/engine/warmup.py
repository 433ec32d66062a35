"""Compile every program an engine can need before it serves, so steady state
compiles nothing (`Engine.counter` proves it in tests)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.engine.runner import DecodeRunner
from jaxpd.engine.sampler import SamplingArrays
from jaxpd.engine.page_allocator import pages_for
from jaxpd.engine.prefill_cache import chunk_widths
from jaxpd.engine.scheduler import context_widths
from jaxpd.models.hf_io import DTYPES
from jaxpd.sizes import coarse_sizes


def warm_up(engine, progress: Callable[[str], None]) -> None:
    """Every prefill (batch, length) bucket and long-prompt chunk, every decode (rows,
    context width), every padded insert and take size and the penalty context update.
    Runs before the engine's threads start; the decode calls only touch the null
    page."""
    for loop in (engine.prefill_loop, engine.local_loop):
        if loop is not None:
            _warm_prefill(loop, progress)
    if engine.decode_loop is not None:
        _warm_decode(engine, progress)
        if engine.decode_loop.extend is not None:
            _warm_extend(engine, progress)


def _warm_prefill(loop, progress: Callable[[str], None]) -> None:
    sched = loop.scheduler
    shapes = sorted({(sched.padded_batch(b, t), t) for t in sched.buckets
                     for b in sched.batch_sizes})
    if loop.chunk_tokens is not None:
        _warm_chunks(loop, progress)
    if loop.cache is not None:
        _warm_prefill_cached(loop, shapes, progress)
        return
    for i, (b, t) in enumerate(shapes):
        progress(f"compiling {loop.runner.name} {i + 1}/{len(shapes)}: batch {b} x {t} tokens")
        args = (np.zeros((b, t), np.int32), np.ones(b, np.int32), SamplingArrays.empty(b))
        if loop.uses_layerwise(t):
            jax.block_until_ready(loop.runner.run_layerwise(*args, loop.layerwise, []))
        else:
            loop.runner.run(*args)


def _warm_chunks(loop, progress: Callable[[str], None]) -> None:
    """A long prompt's chunks (`PrefillLoop._chunk_step`): the first, of a whole chunk
    without a prefix, and each new-token bucket after each prefix width."""
    cache, page_size, chunk = loop.cache, loop.page_size, loop.chunk_tokens
    widths = chunk_widths(chunk // page_size, cache.max_pages)
    shapes = [(chunk, 0)] + [(t, w) for t in cache.new_buckets(chunk, loop.scheduler.buckets)
                             for w in widths]
    context = np.zeros((1, cache.context_width()), np.int32)
    for i, (t, w) in enumerate(shapes):
        progress(f"compiling {cache.name} chunk {i + 1}/{len(shapes)}: {t} tokens, "
                 f"{w} pages of prefix")
        cache.run_chunk(np.zeros((1, t), np.int32), 0, 1, np.zeros((1, w), np.int32),
                        np.zeros((1, pages_for(t, page_size)), np.int32),
                        SamplingArrays.empty(1), context)


def _warm_prefill_cached(loop, shapes, progress: Callable[[str], None]) -> None:
    """A cached prefill batch in bucket `t` runs one of `PrefillCache.shapes(t)` (new
    tokens, prefix pages) (`PrefillLoop._run_cached`). Warm-up compiles those without a
    prefix (what a batch computes when nothing it holds pays, as with the cache off);
    those with one compile in the background on first demand (`start_background`).
    Padding rows write the null page."""
    cache, page_size = loop.cache, loop.page_size
    shapes = sorted({(b, new, w) for b, t in shapes
                     for new, w in cache.shapes(t, loop.scheduler.buckets) if w == 0})
    for i, (b, t, w) in enumerate(shapes):
        progress(f"compiling {cache.name} {i + 1}/{len(shapes)}: batch {b} x {t} tokens, "
                 f"{w} pages of prefix")
        cache.run(np.zeros((b, t), np.int32), np.zeros(b, np.int32), np.ones(b, np.int32),
                  np.zeros((b, w), np.int32), np.zeros((b, pages_for(t, page_size)), np.int32),
                  SamplingArrays.empty(b))
    for m in cache.take_sizes():
        progress(f"compiling {cache.name} page take for {m} pages")
        cache.take([0] * m)
    cache.start_background()


def _warm_decode(engine, progress: Callable[[str], None]) -> None:
    cfg, runner = engine.config, engine.decode_runner
    widths = context_widths(cfg.decode_context_step, cfg.pages_per_slot,
                            engine.decode_loop.by_length)
    loop = engine.decode_loop
    shapes = [(b, w) for b in loop.batch_sizes for w in widths]
    for i, (b, w) in enumerate(shapes):
        progress(f"compiling decode step {i + 1}/{len(shapes)}: {b} rows a shard, "
                 f"{w} pages of context")
        n = b * cfg.mesh.decode_dp
        runner.step(np.zeros(n, np.int32), np.ones(n, bool), np.zeros(n, np.int32),
                    np.zeros((n, w), np.int32), SamplingArrays.empty(n),
                    np.full(n, cfg.slots_per_shard, np.int32))     # padding rows only
    progress("compiling the penalty context update")
    runner.set_penalties(0, [], [])       # zeros: read only after an insert rewrites them
    model = engine.model.cfg
    # A handoff carries its pages padded to `coarse_ceil` of their count: one insert
    # program per padded count.
    for m in coarse_sizes(cfg.pages_per_slot):
        progress(f"compiling page insert for {m} pages")
        shape = (model.num_layers, m, cfg.page_size, model.num_kv_heads, model.head_dim)
        pages = jax.device_put(jnp.zeros(shape, DTYPES[cfg.dtype]), runner.shard_sharding(0))
        runner.insert(0, [0] * m, pages, pages)
    if cfg.mesh.elastic:
        # A re-split cuts each decoding request's pages out of the pool (`engine.elastic`).
        for m in coarse_sizes(cfg.pages_per_slot):
            progress(f"compiling page take for {m} pages")
            runner.take(0, [0] * m)
    jax.block_until_ready(runner.k_pool)


def _warm_extend(engine, progress: Callable[[str], None]) -> None:
    """Prefill-with-context programs: each length bucket, each batch size that fits the
    token budget, and each width of cached prefix a row computing in that bucket can
    have (none included)."""
    loop, page_size = engine.decode_loop.extend, engine.config.page_size
    shapes = set()
    for t in loop.warm_buckets:
        widths = loop.widths(loop.max_prefix_pages(t))
        if loop.lazy:                    # those with a prefix compile on demand
            widths = [w for w in widths if w == 0]
        shapes |= {(rows, t, w) for rows in loop.rows_for(t) for w in widths}
    for i, (rows, t, w) in enumerate(sorted(shapes)):
        progress(f"compiling prefill with context {i + 1}/{len(shapes)}: {rows} x {t} tokens, "
                 f"{w} pages of prefix")
        engine.decode_runner.extend(np.zeros((rows, t), np.int32), np.zeros(rows, np.int32),
                                    np.ones(rows, np.int32), np.zeros((rows, w), np.int32),
                                    np.zeros((rows, pages_for(t, page_size)), np.int32),
                                    np.zeros(rows, np.int32), SamplingArrays.empty(rows))
    if loop.lazy:
        engine.decode_runner.start_background_extend()
