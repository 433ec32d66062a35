"""`PrefillCache`: the prefill mesh's paged pool and its own prefix cache.

Without it a prefill mesh keeps nothing between batches: each batch computes its
prompts into a dense [B, T] bucket, the connector takes the pages, and the next turn
of a conversation computes its whole history again. With it, the prefill mesh owns a
paged pool (split over kv heads by tp, as the bucket is) and every batch runs as a
prefill with context (`Llama.extend`, the program the decode mesh's `ExtendLoop`
runs):

  admit    each request's longest cached prefix of full pages is shared from the
           pool (`PageAllocator`: content-addressed, ref-counted, LRU), pages for the
           rest are allocated (evicting the least recently used unreferenced pages);
  extend   one program computes only the uncached tokens, writing their K/V into the
           request's own pages and attending to the shared ones; samples the first
           token;
  publish  the full pages just written become findable by their hash chain;
  take     a request's pages (from the first one its decode side lacks) are gathered
           out of the pool for the connector, already in the layout the dense path
           cuts;
  release  every reference of the batch is dropped: its pages stay cached until the
           allocator needs room.

With a host tier (`attach_host`, `prefill_host_cache_gb`), the pages the allocator
evicts are copied to host memory (`engine.kv.host_tier`), and `restore` (or `admit`
itself) brings back the ones that continue a request's pooled prefix into its own
pages (one insert program), then publishes them: the batch computes only what
follows, as after a pool hit. The prefill loop restores only for a batch that will
run with its prefix (`restorable` says how much it could get).

References live only within one batch, so a pool of `min_pages` always admits the
largest batch the scheduler can form (the engine checks the size). Requests with
penalties compute their whole prompt (their penalty context is built from the batch's
tokens) but publish their pages like any other: KV does not depend on sampling.
Nothing here is thread-safe: the prefill loop's thread alone calls it.
"""
from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.compile.background import BackgroundCompiler
from jaxpd.engine.kv.host_tier import HostTier
from jaxpd.engine.compile.executable_cache import Executables, KeptExecutables, lowering
from jaxpd.engine.programs.kernels import prefill_attention, prefill_kernel, prefix_attention
from jaxpd.engine.programs.program import FIRST_TWO_IN_PLACE, POOLS_AFTER_PARAMS, Program
from jaxpd.engine.scheduling.page_allocator import (CacheJournal, PageAllocator, page_hashes,
                                                   pages_for)
from jaxpd.engine.programs.penalties import prefill_context
from jaxpd.engine.programs.decode_runner import CompileCounter, host_memory_kind
from jaxpd.engine.programs.sampler import SamplingArrays, sample
from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import Llama, attention_options
from jaxpd.request import Request
from jaxpd.sizes import coarse_ceil, coarse_sizes


def cache_pages(config, scheduler, chunked: bool = False, reuse: bool = True) -> int:
    """Pages (with the null page) of the prefill mesh's cache: `prefill_cache_pages`,
    by default a decode shard's count when it `reuse`s pages (else just what it must
    hold); never fewer than admit any batch `scheduler` forms (references never
    outlive a batch) and, when long prompts are prefilled in chunks (`chunked`), one
    longest request beside it (its pages live across batches); else a ValueError
    naming the field."""
    c = config
    needed = 1 + max(scheduler.batch_cap(b) * min(pages_for(b, c.page_size), c.pages_per_slot)
                     for b in scheduler.buckets)
    if chunked:
        needed += c.pages_per_slot
    if c.prefill_cache_pages is None:
        return max(c.pages_per_shard, needed) if reuse else needed
    if c.prefill_cache_pages < needed:
        raise ValueError(f"prefill_cache_pages={c.prefill_cache_pages} cannot hold the largest "
                         f"prefill batch ({needed} pages with the null page; lower "
                         f"max_prefill_tokens or max_prefill_batch, or raise it)")
    return c.prefill_cache_pages


def _chunk_key(tokens_shape, prefix_shape) -> tuple:
    """A chunk program's key in the background compiler, apart from `run`'s."""
    return ("chunk", tuple(tokens_shape), tuple(prefix_shape))


def chunk_widths(chunk_pages: int, max_pages: int) -> list[int]:
    """Prefix widths (pages) of the chunk programs: `chunk_pages` times powers of two,
    the last capped at `max_pages`. A chunk after `p` pages of prefix gathers the
    first width >= p (`chunk_width`): at most twice its prefix, in a number of
    programs that grows with the logarithm of the context."""
    widths, w = [], chunk_pages
    while True:
        widths.append(min(w, max_pages))
        if w >= max_pages:
            return widths
        w *= 2


def chunk_width(prefix_pages: int, chunk_pages: int, max_pages: int) -> int:
    """The width a chunk after `prefix_pages` pages of prefix gathers (0: none)."""
    if prefix_pages == 0:
        return 0
    return next(w for w in chunk_widths(chunk_pages, max_pages) if w >= prefix_pages)


class PrefillCache:
    """`num_pages` pages of [L, P, S, K, H] K and V on the prefill `mesh`;
    `max_pages`: pages of the longest request (a block table's width is at most this);
    `root`: the hash chain's root (`Engine._prefix_root`); `journal`: where publishes
    and evictions are noted for the router. `root` None: a pool without reuse (prefix
    caching off): every batch and chunk still computes into its pages, released after
    the handoff, but nothing is shared or published. `quant_matmul`: as `PrefillRunner`'s."""

    def __init__(self, cfg: ModelConfig, params, mesh: Mesh, rules, num_pages: int,
                 page_size: int, max_pages: int, root: bytes, counter: CompileCounter,
                 dtype=jnp.float32, fused: bool = False, name: str = "prefill_cached",
                 journal: CacheJournal | None = None, attention_impl: str = "reference",
                 quant_matmul: Callable | None = None):
        self.cfg, self.params, self.page_size, self.max_pages = cfg, params, page_size, max_pages
        self.root, self.counter, self.name = root, counter, name
        self.reuse = root is not None
        self.allocator = PageAllocator(num_pages, journal)
        kv_axis = dict(rules).get("kv_heads")
        pages = NamedSharding(mesh, P(None, None, None, kv_axis, None))
        self._replicated = NamedSharding(mesh, P())
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pages)
        self.k_pool, self.v_pool = zeros(), zeros()
        attention = prefill_attention(attention_impl, mesh, rules, cfg.head_dim)
        self.kernel = prefill_kernel(attention)
        prefix_core = prefix_attention(attention_impl, mesh, rules, cfg.head_dim)
        # The native prefix core reads each row's real prefix in place, whatever its
        # table's width (a layer with a window or softcap gathers the table instead):
        # then one width, the longest request's, serves every prefix and none, and a
        # program per (rows, new tokens) serves every batch, all compiled by warm-up.
        # (Without reuse no batch has a prefix: the prompt core, as ever.)
        self.prefix_in_place = self.reuse and prefix_core is not None and not any(
            attention_options(cfg, i) for i in range(cfg.num_layers))
        model = Llama(cfg, dtype, fused, prefill_attention=attention,
                      prefix_attention=prefix_core, qmatmul=quant_matmul)

        def extend(params, k_pool, v_pool, tokens, starts, lengths, prefix_tables, new_tables,
                   sampling):
            with nn.logical_axis_rules(rules):
                logits, k_pool, v_pool = model.apply(
                    {"params": params}, tokens, starts, lengths, k_pool, v_pool, prefix_tables,
                    new_tables, method=Llama.extend)
            # Only rows without a cached prefix have penalties (`admit`): their tokens
            # are their whole prompt, as in a dense prefill.
            context = lambda: prefill_context(tokens, lengths, sampling.prompt_len,
                                              logits.shape[-1])
            first, logprobs = sample(logits, sampling, starts + lengths, context)
            return first, logprobs, k_pool, v_pool

        self._extend = jax.jit(extend, donate_argnums=(1, 2),
                               out_shardings=(self._replicated, self._replicated, pages, pages))

        def extend_chunk(params, k_pool, v_pool, tokens, starts, lengths, prefix_tables,
                         new_tables, sampling, context_tokens, context_lengths):
            # One chunk of a long prompt: the first token (sampled after the last chunk)
            # is penalised by the whole prompt, not by this chunk's tokens alone.
            with nn.logical_axis_rules(rules):
                logits, k_pool, v_pool = model.apply(
                    {"params": params}, tokens, starts, lengths, k_pool, v_pool, prefix_tables,
                    new_tables, method=Llama.extend)
            context = lambda: prefill_context(context_tokens, context_lengths,
                                              sampling.prompt_len, logits.shape[-1])
            first, logprobs = sample(logits, sampling, starts + lengths, context)
            return first, logprobs, k_pool, v_pool

        self._extend_chunk = jax.jit(extend_chunk, donate_argnums=(1, 2),
                                     out_shardings=(self._replicated, self._replicated, pages,
                                                    pages))
        self._take = jax.jit(lambda k, v, ids: (k[:, ids], v[:, ids]),
                             out_shardings=(pages, pages))
        self._pages = pages
        # Evicted pages copied out for the host tier land in pinned host memory where
        # the devices have it (`DecodeRunner.offload`); restored ones are inserted.
        kind = host_memory_kind(mesh)
        offloaded = NamedSharding(mesh, P(), **({"memory_kind": kind} if kind else {}))
        self._offload = jax.jit(lambda k, v, ids: (k[:, ids], v[:, ids]),
                                out_shardings=(offloaded, offloaded))
        self._insert = jax.jit(
            lambda k_pool, v_pool, k, v, ids: (k_pool.at[:, ids].set(k),
                                               v_pool.at[:, ids].set(v)),
            donate_argnums=(0, 1), out_shardings=(pages, pages))
        self.host: HostTier | None = None
        self.restored_tokens = 0       # of the last `admit`: from the host tier
        # After warm-up (`start_background`), programs with a prefix compile on demand
        # in the background; the loop serves a batch without its prefix meanwhile.
        self.compiler: BackgroundCompiler | None = None
        self._chunk_keys: list[tuple] = []
        # The programs warm-up installed, by the key each serving call computes; what
        # the background compiles is loaded where `keep` kept it.
        self.executables = Executables()
        self.keep = KeptExecutables(None)

    def start_background(self, chunks: list[tuple[int, int]] = (),
                         keep: KeptExecutables | None = None) -> None:
        """From now on `ready` asks for a program with a prefix it lacks, compiled on a
        thread of its own (or loaded where `keep` kept it), instead of letting the
        batch compile it. `chunks`: the (new tokens, prefix pages) of every chunk
        program (`run_chunk`), asked for at once on that thread; until all are compiled
        `chunks_ready` is False."""
        if keep is not None:
            self.keep = keep
        self.compiler = BackgroundCompiler(f"{self.name}_background", self.counter)
        for t, w in chunks:
            key = _chunk_key((1, t), (1, w))
            self._chunk_keys.append(key)
            self.compiler.request(key, lambda t=t, w=w: self._lower_chunk(t, w))

    def chunks_ready(self) -> bool:
        """Whether every chunk program runs without compiling first (as `ready`; one
        whose background compile failed compiles where it runs)."""
        c = self.compiler
        return c is None or all(c.get(k) is not None or k in c.failed for k in self._chunk_keys)

    def _lower_chunk(self, length: int, width: int):
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        program = self.chunk_program(zeros(1, length), 0, 1, zeros(1, width),
                                     zeros(1, pages_for(length, self.page_size)),
                                     SamplingArrays.empty(1), zeros(1, self.context_width()))
        return lowering(self.keep, program)

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop the background compiles (`BackgroundCompiler.close`)."""
        if self.compiler is not None:
            self.compiler.close(timeout_s)

    def ready(self, rows: int, length: int, width: int) -> bool:
        """Whether a batch of `rows` x `length` new tokens after `width` pages of prefix
        runs without compiling first: always before `start_background` (it compiles
        where it runs, as warm-up does), for no prefix and with `prefix_in_place`
        (warm-up compiled those); else once the background compile is done (asked for
        here, the first time)."""
        if self.compiler is None or width == 0 or self.prefix_in_place:
            return True
        return self.compiler.ready(((rows, length), (rows, width)),
                                   lambda: self._lower(rows, length, width))

    def anticipate(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile these (rows, new tokens, prefix pages) programs in the background
        before any batch asks for them, in this order, after whatever a batch asks for
        (`BackgroundCompiler.anticipate`; after `start_background`)."""
        for rows, length, width in shapes:
            self.compiler.anticipate(((rows, length), (rows, width)),
                                     lambda r=rows, t=length, w=width: self._lower(r, t, w))

    def _lower(self, rows: int, length: int, width: int):
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        program = self.run_program(zeros(rows, length), zeros(rows), zeros(rows),
                                   zeros(rows, width),
                                   zeros(rows, pages_for(length, self.page_size)),
                                   SamplingArrays.empty(rows))
        return lowering(self.keep, program)

    def attach_host(self, tier: HostTier) -> None:
        """Keep evicted prefix pages in `tier` (made on this cache: `HostTier(cache,
        ...)`) and restore them (see the module)."""
        if not self.reuse:
            raise ValueError("a host tier needs the prefix cache (a root to hash pages by)")
        self.host = tier
        self.allocator.on_evict = lambda pairs: tier.evicted(0, pairs)

    # ---- the host tier's view of the pool (`host_tier.PagePool`; one shard, 0) --------

    def pages_shape(self, m: int) -> tuple[int, ...]:
        """[L, m, S, K, H]: `m` pages of this pool."""
        return (self.k_pool.shape[0], m) + self.k_pool.shape[2:]

    def shard_sharding(self, shard: int) -> NamedSharding:
        """Where pages must be to be inserted (split over kv heads as the pool is)."""
        return self._pages

    def offload(self, shard: int, page_ids: list[int]):
        """Copies of the pages at `page_ids` for the host tier, padded with the null
        page to `coarse_ceil` of their count ([L, m, S, K, H]), dispatched, not waited
        for: a program dispatched after it that writes these pages runs after it."""
        m = coarse_ceil(len(page_ids))
        self.counter.note(f"{self.name}_offload", m)
        return self.executables.get(("offload", m), self._offload)(*self._take_args(page_ids))

    def offload_program(self, m: int) -> Program:
        """The program `offload` dispatches for `m` padded pages."""
        return Program(f"{self.name}_offload_m{m}", self._offload, self._take_args([0] * m),
                       host_sharding=self._replicated,
                       note=functools.partial(self.counter.note, f"{self.name}_offload", m),
                       install=functools.partial(self.executables.put, ("offload", m)))

    def insert(self, shard: int, page_ids: list[int], k_pages, v_pages) -> None:
        """Write [L, m, S, K, H] pages (on `shard_sharding`; m = `coarse_ceil` of their
        real count) at `page_ids`, one id per real page; padding goes to the null page."""
        m = k_pages.shape[1]
        self.counter.note(f"{self.name}_insert", m)
        insert = self.executables.get(("insert", m), self._insert)
        self.k_pool, self.v_pool = insert(*self._insert_args(page_ids, k_pages, v_pages))

    def _insert_args(self, page_ids: list[int], k_pages, v_pages):
        ids = np.zeros(k_pages.shape[1], np.int32)
        ids[:len(page_ids)] = page_ids
        return self.k_pool, self.v_pool, k_pages, v_pages, jax.device_put(ids, self._replicated)

    def insert_program(self, m: int) -> Program:
        """The program `insert` dispatches for `m` padded pages."""
        pages = jax.ShapeDtypeStruct(self.pages_shape(m), self.k_pool.dtype,
                                     sharding=self._pages)         # shapes: nothing allocated
        return Program(f"{self.name}_insert_m{m}", self._insert,
                       self._insert_args([0] * m, pages, pages),
                       note=functools.partial(self.counter.note, f"{self.name}_insert", m),
                       install=functools.partial(self.executables.put, ("insert", m)),
                       carried=FIRST_TWO_IN_PLACE)

    def host_sizes(self) -> list[int]:
        """Padded page counts the host tier offloads and inserts (warm-up's)."""
        return self.host.sizes() if self.host is not None else []

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        return page_hashes(token_ids, self.page_size, self.root) if self.reuse else []

    def admit(self, requests: list[Request], share: bool = True, restore: bool = True
              ) -> list[tuple[list[int], int, list[bytes]]]:
        """For each request, in order: (its pages, cached tokens, its full pages'
        hashes), with one reference taken to each page. At least its last token is
        computed (its logits give the first token). `share` False: every page is the
        request's own (nothing cached is used; its pages are still published after).
        Raises `OutOfPages` (nothing taken) only if the pool is smaller than
        `cache_pages`. With a host tier (and `restore`; else see `restore`), the pages
        continuing a shared prefix that it holds are restored into the request's first
        own pages and published, and count as cached (`restored_tokens`: how many, over
        the requests)."""
        admitted, self.restored_tokens = [], 0
        if self.host is not None:
            self.host.settle()
        try:
            for r in requests:
                ids = r.prefill_ids
                n = len(ids)
                hashes = self.hashes(ids)
                usable = hashes[:(n - 1) // self.page_size]
                use = share and self.reuse and not r.params.has_penalties
                shared = self.allocator.cached_prefix(usable) if use else []
                self.allocator.share(shared)
                admitted.append((shared, 0, hashes))
                own = self.allocator.allocate(pages_for(n, self.page_size) - len(shared))
                admitted[-1] = (shared + own, len(shared) * self.page_size, hashes)
                restored = self._restore(own, usable[len(shared):]) if use and restore else 0
                admitted[-1] = (shared + own, (len(shared) + restored) * self.page_size, hashes)
        except Exception:
            self.release([pages for pages, _, _ in admitted])
            raise
        return admitted

    def restorable(self, request: Request, row: tuple[list[int], int, list[bytes]]) -> int:
        """Tokens the host tier could add to the cached prefix of `row` (`admit`'s, made
        with `restore` False): a hint, `restore` checks."""
        if self.host is None or request.params.has_penalties:
            return 0
        _, cached, hashes = row
        usable = hashes[cached // self.page_size:(len(request.prefill_ids) - 1) // self.page_size]
        return self.host.restorable(usable[:self.host.max_pages]) * self.page_size

    def restore(self, requests: list[Request], admitted: list[tuple[list[int], int, list[bytes]]]
                ) -> list[tuple[list[int], int, list[bytes]]]:
        """`admitted` (`admit`'s with `restore` False) with what the host tier holds
        past each row's cached prefix restored into its own pages and counted as
        cached (`restored_tokens` grows by it)."""
        out = []
        for r, (pages, cached, hashes) in zip(requests, admitted):
            first = cached // self.page_size
            usable = hashes[first:(len(r.prefill_ids) - 1) // self.page_size]
            n = 0 if r.params.has_penalties else self._restore(pages[first:], usable)
            out.append((pages, cached + n * self.page_size, hashes))
        return out

    def _restore(self, own: list[int], hashes: list[bytes]) -> int:
        """Restore the host tier's leading run of `hashes` into the first `own` pages and
        publish them; how many."""
        if self.host is None or not hashes:
            return 0
        pages = self.host.fetch(hashes[:self.host.max_pages])
        if not pages:
            return 0
        ids = own[:len(pages)]
        self.host.restore(0, ids, pages)
        self.publish(ids, hashes[:len(pages)], 0)
        self.restored_tokens += len(pages) * self.page_size
        return len(pages)

    def release(self, pages: list[list[int]]) -> None:
        for p in pages:
            self.allocator.free(p)

    def run(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
            prefix_tables: np.ndarray, new_tables: np.ndarray, sampling: SamplingArrays):
        """Rows [B] of `lengths` new tokens at positions from `starts`, after the
        prefix in the pages of `prefix_tables` [B, W] (W may be 0: no prefix), into
        the pages of `new_tables` [B, T / page_size] (`Llama.extend`) -> (first tokens
        as numpy [B], their `Logprobs` as numpy when some row asks for them, else
        None)."""
        key = (tokens.shape, prefix_tables.shape)
        program = self.compiler.get(key) if self.compiler is not None else None
        if program is None:
            self.counter.note(self.name, key)
            program = self.executables.get(("run", key), self._extend)
        first, logprobs, self.k_pool, self.v_pool = program(*self._run_args(
            tokens, starts, lengths, prefix_tables, new_tables, sampling))
        return (np.asarray(first), jax.device_get(logprobs) if sampling.wants_logprobs else None)

    def _run_args(self, tokens, starts, lengths, prefix_tables, new_tables, sampling):
        return (self.params, self.k_pool, self.v_pool,
                *jax.device_put((tokens, starts, lengths, prefix_tables, new_tables, sampling),
                                self._replicated))

    def run_program(self, tokens, starts, lengths, prefix_tables, new_tables,
                    sampling: SamplingArrays) -> Program:
        """The program `run` dispatches for these inputs' shapes."""
        (b, t), w = tokens.shape, prefix_tables.shape[1]
        return Program(f"{self.name}_b{b}_t{t}_w{w}", self._extend,
                       self._run_args(tokens, starts, lengths, prefix_tables, new_tables,
                                      sampling), self.kernel,
                       note=functools.partial(self.counter.note, self.name,
                                              (tokens.shape, prefix_tables.shape)),
                       install=functools.partial(self.executables.put,
                                                 ("run", (tokens.shape, prefix_tables.shape))),
                       carried=POOLS_AFTER_PARAMS)

    def run_chunk(self, tokens: np.ndarray, start: int, length: int, prefix_table: np.ndarray,
                  new_table: np.ndarray, sampling: SamplingArrays, context: np.ndarray):
        """One chunk of one long prompt: `length` new tokens (`tokens` [1, T], padded)
        at positions from `start`, after the prefix in the pages of `prefix_table`
        [1, W] (W may be 0), into the pages of `new_table` [1, T / page_size];
        `context` [1, max_pages * page_size]: the whole prompt (padded), which the
        first token's penalties read. Returns what `run` returns; only the last chunk's
        first token means anything."""
        key = (tokens.shape, prefix_table.shape)
        program = self.compiler.get(_chunk_key(*key)) if self.compiler is not None else None
        if program is None:
            self.counter.note(f"{self.name}_chunk", key)
            program = self._extend_chunk
        first, logprobs, self.k_pool, self.v_pool = program(*self._chunk_args(
            tokens, start, length, prefix_table, new_table, sampling, context))
        return (np.asarray(first), jax.device_get(logprobs) if sampling.wants_logprobs else None)

    def _chunk_args(self, tokens, start, length, prefix_table, new_table, sampling, context):
        starts, lengths = np.array([start], np.int32), np.array([length], np.int32)
        context_lengths = np.array([start + length], np.int32)
        return (self.params, self.k_pool, self.v_pool,
                *jax.device_put((tokens, starts, lengths, prefix_table, new_table, sampling,
                                 context, context_lengths), self._replicated))

    def chunk_program(self, tokens, start, length, prefix_table, new_table,
                      sampling: SamplingArrays, context) -> Program:
        """The program `run_chunk` dispatches for these inputs' shapes."""
        t, w = tokens.shape[1], prefix_table.shape[1]
        return Program(f"{self.name}_chunk_t{t}_w{w}", self._extend_chunk,
                       self._chunk_args(tokens, start, length, prefix_table, new_table,
                                        sampling, context), self.kernel,
                       carried=POOLS_AFTER_PARAMS)

    def context_width(self) -> int:
        """Tokens of `run_chunk`'s `context`: the longest request's pages."""
        return self.max_pages * self.page_size

    def publish(self, pages: list[int], hashes: list[bytes], start: int) -> None:
        """The full pages from index `start` on were just written: make them findable.
        A page whose tokens another page already holds stays private (freed, not cached,
        on release)."""
        for i in range(start, len(hashes)):
            self.allocator.publish(pages[i], hashes[i])

    def take(self, page_ids: list[int]):
        """The K and V of these pages, then padding pages up to `coarse_ceil` of their
        count (what a handoff carries: `KVHandoff`), [L, m, S, K, H] each, for the
        connector. One program per padded count (`take_sizes`, all warmed up)."""
        m = coarse_ceil(len(page_ids))
        self.counter.note(f"{self.name}_take", m)
        return self.executables.get(("take", m), self._take)(*self._take_args(page_ids))

    def _take_args(self, page_ids: list[int]):
        ids = np.zeros(coarse_ceil(len(page_ids)), np.int32)     # padding: the null page
        ids[:len(page_ids)] = page_ids
        return self.k_pool, self.v_pool, jax.device_put(ids, self._replicated)

    def take_program(self, m: int) -> Program:
        """The program `take` dispatches for `m` padded pages."""
        return Program(f"{self.name}_take_m{m}", self._take, self._take_args([0] * m),
                       note=functools.partial(self.counter.note, f"{self.name}_take", m),
                       install=functools.partial(self.executables.put, ("take", m)))

    def take_sizes(self) -> list[int]:
        """Every padded count `take` can cut (a request's pages, at most `max_pages`)."""
        return coarse_sizes(self.max_pages)

    def new_buckets(self, length: int, buckets: list[int]) -> list[int]:
        """Padded lengths of the uncached tokens a batch in the `length` bucket may
        compute, ascending. With `prefix_in_place`, every bucket up to `length`: a
        batch of b rows in a smaller bucket is a shape the scheduler forms anyway
        (`shapes`), so they add no program. Else `coarse_new_buckets`."""
        if self.prefix_in_place:
            return [b for b in buckets if b <= length]
        return self.coarse_new_buckets(length, buckets)

    def coarse_new_buckets(self, length: int, buckets: list[int]) -> list[int]:
        """The bucket `length` itself, then every fourth power of two below it, and the
        smallest bucket, ascending. Coarser than the prefill buckets (at most 4x the
        padding of the new tokens) because each is one more program per (batch, bucket)
        to compile. Without `prefix_in_place`, a batch that lands in the bucket itself
        computes every token, with no prefix (`PrefillLoop._run_cached`): at most a
        quarter of the bucket is worth a prefix's attention, which reads the whole
        table's width."""
        out, t = [], length
        while t >= buckets[0]:
            out.append(t)
            t //= 4
        if buckets[0] < length and buckets[0] not in out:
            out.append(buckets[0])
        return sorted(out)

    def width(self, length: int) -> int:
        """Block-table width (pages) of a batch in the `length` bucket that reads a
        prefix: the longest request's pages with `prefix_in_place`, else the bucket's."""
        if self.prefix_in_place:
            return self.max_pages
        return min(pages_for(length, self.page_size), self.max_pages)

    def fresh_width(self, length: int) -> int:
        """Block-table width of a batch in the `length` bucket that computes every
        token: the same program as with a prefix where it is read in place (no
        program of its own), else none."""
        return self.width(length) if self.prefix_in_place else 0

    def shapes(self, length: int, buckets: list[int]) -> list[tuple[int, int]]:
        """(new tokens, prefix pages) of every program a batch in the `length` bucket
        may run: the bucket itself without a prefix, each smaller new-token bucket
        after a prefix as wide as the bucket (with `prefix_in_place`, every one of
        them at the one width)."""
        return [(t, self.fresh_width(length) if t == length else self.width(length))
                for t in self.new_buckets(length, buckets)]

