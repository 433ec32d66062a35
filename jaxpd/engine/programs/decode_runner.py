"""The decode mesh's jitted programs and the state they own, and what every runner
shares (`CompileCounter`, `host_memory_kind`); the prefill mesh's are
`engine.programs.prefill_runner`.

`DecodeRunner`   decode mesh (dp x tp): owns the paged KV pool and the slots' penalty
                 context (`penalties.SlotPenalties`), donated into every call so updates
                 happen in place. `insert` writes arrived pages (padded to `coarse_ceil`
                 of their count), `set_penalties` a slot's penalty context, `step` feeds
                 one token to each of some slots (a row each) and samples the next
                 (penalties and log-probabilities per row, `sampler`), `extend` prefills
                 with context into a slot's pages. All run under `shard_map` over dp:
                 each dp shard touches only its own slots and pages, block tables hold
                 shard-local page ids, tp inside a shard is GSPMD's.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.compile.background import BackgroundCompiler
from jaxpd.engine.compile.executable_cache import Executables, KeptExecutables, lowering
from jaxpd.engine.programs.program import FIRST_TWO_IN_PLACE, POOLS_AFTER_PARAMS, Program
from jaxpd.sizes import coarse_ceil
from jaxpd.engine.programs.penalties import SlotPenalties, count_sampled
from jaxpd.engine.programs.sampler import Logprobs, SamplingArrays, sample
from jaxpd.models.config import ModelConfig
from jaxpd.engine.programs.kernels import extend_attention, kernel_per_tp_shard
from jaxpd.engine.programs.experts import decode_experts, param_specs
from jaxpd.models.llama import Llama
from jaxpd.models.pallas_attention import decode_attention
from jaxpd.sharding.compat import shard_map


def host_memory_kind(mesh: Mesh) -> str | None:
    """JAX's pinned host memory kind where `mesh`'s devices have one and are not CPUs
    (whose memory is host memory already, so a numpy array stands in); else None."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        return None
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    return "pinned_host" if "pinned_host" in kinds else None


class CompileCounter:
    """Counts distinct compiled shapes per program (thread-safe), to prove steady state."""

    def __init__(self):
        self._seen: dict[str, set] = {}
        self._lock = threading.Lock()

    def note(self, program: str, key) -> None:
        with self._lock:
            self._seen.setdefault(program, set()).add(key)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {k: len(v) for k, v in self._seen.items()}

    @property
    def total(self) -> int:
        return sum(self.counts().values())


class DecodeRunner:
    """`fused`: `params` are `fuse_params`'s tree (`place_params` says which).
    `quant_matmul`: the product of quantized weights (`models.quant.native_matmul`)
    where the engine found it serves this mesh, else None (the jnp form)."""

    def __init__(self, cfg: ModelConfig, params, mesh: Mesh, rules, num_slots: int,
                 pages_per_shard: int, page_size: int, counter: CompileCounter,
                 dtype=jnp.float32, fused: bool = False, attention_impl: str = "reference",
                 attention_interpret: bool = False, quant_matmul: Callable | None = None):
        self.cfg, self.params, self.mesh = cfg, params, mesh
        self.page_size, self.counter = page_size, counter
        self.pages_per_shard = pages_per_shard
        self.attention_impl = self.kernel = attention_impl
        # The programs warm-up installed, by the key each serving call computes.
        self.executables = Executables()
        self.keep = KeptExecutables(None)      # warm-up's (`start_background_extend`)
        self.quant_matmul = quant_matmul
        self.num_shards = mesh.shape["dp"]
        kv_axis = dict(rules).get("kv_heads")
        self.pool_spec = P(None, "dp", None, kv_axis, None)          # [L, P, S, K, H]
        self.page_spec = P(None, None, None, kv_axis, None)          # one shard's pages
        shape = (cfg.num_layers, self.num_shards * pages_per_shard, page_size,
                 cfg.num_kv_heads, cfg.head_dim)
        pool_sharding = self.pool_sharding = NamedSharding(mesh, self.pool_spec)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool_sharding)
        self.k_pool, self.v_pool = zeros(), zeros()
        self.slot_sharding = NamedSharding(mesh, P("dp"))
        self.prev_tokens = jax.device_put(np.zeros(num_slots, np.int32), self.slot_sharding)
        self.penalties = SlotPenalties(mesh, num_slots, cfg.vocab_size)
        self._submeshes = [Mesh(mesh.devices[d:d + 1], ("dp", "tp")) for d in range(self.num_shards)]
        self._zeros_cache: dict = {}
        attention = decode_attention(attention_impl, attention_interpret)
        if attention_impl != "reference":
            attention = kernel_per_tp_shard(attention, kv_axis)
        # Its own prefills with context: the native prompt and prefix cores on each tp
        # shard where they serve, else the reference.
        prompt_core, prefix_core = extend_attention(attention_impl, kv_axis, cfg.head_dim)
        self.extend_kernel = "reference" if prefix_core is None else "native"
        model = Llama(cfg, dtype, fused, attention, prefill_attention=prompt_core,
                      prefix_attention=prefix_core,
                      experts=decode_experts(rules, quant_matmul), qmatmul=quant_matmul)
        # jax's varying-axes check cannot type a kernel's output.
        check_vma = attention_impl == "reference" and quant_matmul is None

        def step(params, k_pool, v_pool, counts, prompt, prev, rows, host_tokens, fed_from_host,
                 positions, block_tables, sampling):
            # One shard's rows: row b feeds slot rows[b] (padding rows name no slot:
            # they read slot 0's state and write nothing back but the null page).
            held = jnp.minimum(rows, prev.shape[0] - 1)
            tokens = jnp.where(fed_from_host, host_tokens, prev[held])
            with nn.logical_axis_rules(rules):
                logits, k_pool, v_pool = model.apply({"params": params}, tokens, positions, k_pool,
                                                     v_pool, block_tables, method=Llama.decode)
            nxt, logprobs = sample(logits, sampling, positions + 1,
                                   lambda: (counts[held], prompt[held]))
            counts = count_sampled(counts, rows, nxt, sampling)
            return nxt, logprobs, k_pool, v_pool, counts, prev.at[rows].set(nxt, mode="drop")

        slot = P("dp")
        pool = P(None, "dp")
        # Params whole on every dp shard, but a mixture's experts split over dp where
        # the rules split them (`engine.programs.experts`).
        weights = param_specs(params, rules)
        # The state a call returns is the next call's input, so its layout is fixed
        # here: over `tp` (left to the compiler by a `shard_map` manual over `dp`) it
        # would be the compiler's choice, which a kept executable then refuses.
        slots = self.slot_sharding
        self._step = jax.jit(shard_map(
            step, mesh=mesh, axis_names={"dp"}, check_vma=check_vma,
            in_specs=(weights, pool, pool) + (slot,) * 9,
            out_specs=(slot, slot, pool, pool, slot, slot)),
            donate_argnums=(1, 2, 3, 5),
            out_shardings=(slots, slots, pool_sharding, pool_sharding, slots, slots))
        self.slots_per_shard = num_slots // self.num_shards

        def extend(params, k_pool, v_pool, counts, prompt, tokens, starts, lengths,
                   prefix_tables, new_tables, row_slots, sampling):
            with nn.logical_axis_rules(rules):
                logits, k_pool, v_pool = model.apply(
                    {"params": params}, tokens, starts, lengths, k_pool, v_pool, prefix_tables,
                    new_tables, method=Llama.extend)
            # Penalties read the slot's context, set (`set_penalties`) before the call.
            nxt, logprobs = sample(logits, sampling, starts + lengths,
                                   lambda: (counts[row_slots], prompt[row_slots]))
            return nxt, logprobs, k_pool, v_pool

        self._extend = jax.jit(shard_map(
            extend, mesh=mesh, axis_names={"dp"},
            check_vma=quant_matmul is None and prefix_core is None,
            in_specs=(weights, pool, pool, slot, slot) + (slot,) * 7,
            out_specs=(slot, slot, pool, pool)), donate_argnums=(1, 2),
            out_shardings=(slots, slots, pool_sharding, pool_sharding))

        def insert(k_pool, v_pool, k_new, v_new, page_ids):
            return k_pool.at[:, page_ids].set(k_new), v_pool.at[:, page_ids].set(v_new)

        self._insert = jax.jit(shard_map(
            insert, mesh=mesh, axis_names={"dp"},
            in_specs=(pool, pool, pool, pool, slot), out_specs=(pool, pool)),
            donate_argnums=(0, 1), out_shardings=(pool_sharding, pool_sharding))
        # A decode mesh beside a prefill mesh compiles its programs with a prefix on
        # demand, in the background (`start_background_extend`), and runs each once
        # before a request does (`prime_extend`): extend keys that have run, and those
        # compiled and asked for (by routing, on another thread) but not run yet.
        self.extend_compiler: BackgroundCompiler | None = None
        self._ran: set = set()
        self._prime_asked: set = set()
        self._prime_lock = threading.Lock()
        self._take = jax.jit(lambda k_pool, v_pool, ids: (k_pool[:, ids], v_pool[:, ids]))
        # Pages copied out for the host tier land in pinned host memory where the
        # devices have it: the program's own output is the device-to-host copy.
        kind = host_memory_kind(mesh)
        offloaded = NamedSharding(mesh, P(), **({"memory_kind": kind} if kind else {}))
        self._offload = jax.jit(lambda k_pool, v_pool, ids: (k_pool[:, ids], v_pool[:, ids]),
                                out_shardings=(offloaded, offloaded))

    def shard_sharding(self, shard: int) -> NamedSharding:
        """Where a request's pages must land to be inserted on `shard`."""
        return NamedSharding(self._submeshes[shard], self.page_spec)

    def insert(self, shard: int, page_ids: list[int], k_pages, v_pages) -> None:
        """Write [L, m, S, K, H] pages (already on `shard_sharding(shard)`; m =
        `coarse_ceil` of their real count, as a handoff carries them) at `page_ids`, one
        id per real page; the padding pages go to the null page 0. One program per m."""
        n, m = len(page_ids), k_pages.shape[1]
        if m != coarse_ceil(m) or not 1 <= n <= m or m < coarse_ceil(n):
            raise ValueError(f"insert of {n} pages takes coarse_ceil({n}) = {coarse_ceil(n)} "
                             f"padded pages, got {m}")
        self.counter.note("insert", m)
        insert = self.executables.get(("insert", m), self._insert)
        self.k_pool, self.v_pool = insert(*self._insert_args(shard, page_ids, k_pages, v_pages))

    def _insert_args(self, shard: int, page_ids: list[int], k_pages, v_pages):
        m = k_pages.shape[1]
        ids = np.zeros((self.num_shards, m), np.int32)
        ids[shard, :len(page_ids)] = page_ids           # padding rows write the null page 0
        ids = jax.device_put(ids.reshape(-1), self.slot_sharding)
        return (self.k_pool, self.v_pool, self._assemble(shard, k_pages),
                self._assemble(shard, v_pages), ids)

    def insert_program(self, m: int) -> Program:
        """The program `insert` dispatches for `m` padded pages (its pages as shapes:
        what `_assemble` makes of one shard's, nothing allocated)."""
        l, _, *rest = self.pages_shape(m)
        pages = jax.ShapeDtypeStruct((l, self.num_shards * m, *rest), self.k_pool.dtype,
                                     sharding=NamedSharding(self.mesh, self.pool_spec))
        ids = np.zeros(self.num_shards * m, np.int32)
        return Program(f"insert_m{m}", self._insert,
                       (self.k_pool, self.v_pool, pages, pages,
                        jax.device_put(ids, self.slot_sharding)),
                       note=functools.partial(self.counter.note, "insert", m),
                       install=functools.partial(self.executables.put, ("insert", m)),
                       carried=FIRST_TWO_IN_PLACE)

    def pages_shape(self, m: int) -> tuple[int, ...]:
        """[L, m, S, K, H]: `m` pages of this pool."""
        return (self.k_pool.shape[0], m) + self.k_pool.shape[2:]

    def take(self, shard: int, page_ids: list[int]) -> tuple[jax.Array, jax.Array]:
        """Copies of `shard`'s [L, m, S, K, H] pages at `page_ids`, padded (with its null
        page) to m = `coarse_ceil` of their count as a handoff is: an elastic re-split
        moves a decoding request's KV with them."""
        m = coarse_ceil(len(page_ids))
        self.counter.note("take", m)
        return self.executables.get(("take", m), self._take)(*self._take_args(shard, page_ids))

    def _take_args(self, shard: int, page_ids: list[int]):
        ids = np.zeros(coarse_ceil(len(page_ids)), np.int32)
        ids[:len(page_ids)] = page_ids
        return self.k_pool, self.v_pool, ids + shard * self.pages_per_shard

    def take_program(self, m: int) -> Program:
        """The program `take` dispatches for `m` padded pages."""
        return Program(f"take_m{m}", self._take, self._take_args(0, [0] * m),
                       host_sharding=NamedSharding(self.mesh, P()),
                       note=functools.partial(self.counter.note, "take", m),
                       install=functools.partial(self.executables.put, ("take", m)))

    def offload(self, shard: int, page_ids: list[int]) -> tuple[jax.Array, jax.Array]:
        """Copies of `shard`'s pages at `page_ids` for the host tier, as `take` cuts
        them ([L, m, S, K, H], m = `coarse_ceil` of their count, padded with the null
        page), in pinned host memory where the devices have it. Dispatched, not waited
        for: a program dispatched after it that writes these pages runs after it."""
        m = coarse_ceil(len(page_ids))
        self.counter.note("offload", m)
        offload = self.executables.get(("offload", m), self._offload)
        return offload(*self._take_args(shard, page_ids))

    def offload_program(self, m: int) -> Program:
        """The program `offload` dispatches for `m` padded pages."""
        return Program(f"offload_m{m}", self._offload, self._take_args(0, [0] * m),
                       host_sharding=NamedSharding(self.mesh, P()),
                       note=functools.partial(self.counter.note, "offload", m),
                       install=functools.partial(self.executables.put, ("offload", m)))

    def penalties_program(self) -> Program:
        """The program `set_penalties` dispatches (one for every slot and length)."""
        p = self.penalties
        return Program("penalties_set_slot", p.set_row_program, p.set_slot_args(0, [], []),
                       note=functools.partial(self.counter.note, "set_penalties", ()),
                       install=functools.partial(self.executables.put, ("set_penalties", ())),
                       carried=FIRST_TWO_IN_PLACE)

    def set_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """The penalty context of the request just inserted at `slot` (one with penalties)."""
        self.counter.note("set_penalties", ())
        p = self.penalties
        set_row = self.executables.get(("set_penalties", ()), p.set_row_program)
        p.counts, p.prompt = set_row(*p.set_slot_args(slot, prompt_ids, output_ids))

    def step(self, host_tokens, fed_from_host, positions, block_tables, sampling: SamplingArrays,
             rows=None) -> tuple[jax.Array, Logprobs]:
        """Dispatch one decode step (asynchronously) over D x b rows (b per dp shard, in
        shard order): row i feeds the shard-local slot `rows[i]` (`slots_per_shard`:
        padding); None: every slot, in order. Returns the rows' next tokens [D x b] and
        their `Logprobs`, on device (read them back only when some row asked). One
        program per (b, context width)."""
        self.counter.note("decode", block_tables.shape)
        p = self.penalties
        step = self.executables.get(("decode", block_tables.shape), self._step)
        nxt, logprobs, self.k_pool, self.v_pool, p.counts, self.prev_tokens = step(
            *self._step_args(host_tokens, fed_from_host, positions, block_tables, sampling, rows))
        return nxt, logprobs

    def _step_args(self, host_tokens, fed_from_host, positions, block_tables, sampling, rows):
        rows = self.every_slot() if rows is None else rows
        p = self.penalties
        return (self.params, self.k_pool, self.v_pool, p.counts, p.prompt, self.prev_tokens,
                rows, host_tokens, fed_from_host, positions, block_tables, sampling)

    def step_program(self, host_tokens, fed_from_host, positions, block_tables,
                     sampling: SamplingArrays, rows=None) -> Program:
        """The program `step` dispatches for these inputs' shapes."""
        n, w = block_tables.shape
        return Program(f"decode_rows{n}_w{w}", self._step,
                       self._step_args(host_tokens, fed_from_host, positions, block_tables,
                                       sampling, rows), self.kernel, self.slot_sharding,
                       note=functools.partial(self.counter.note, "decode", block_tables.shape),
                       install=functools.partial(self.executables.put,
                                                 ("decode", block_tables.shape)),
                       carried=((1, 2), (2, 3), (3, 4), (5, 5)))

    def every_slot(self) -> np.ndarray:
        """`step`'s rows for every slot, in order: each shard's local slot ids."""
        return np.tile(np.arange(self.slots_per_shard, dtype=np.int32), self.num_shards)

    def extend(self, tokens, starts, lengths, prefix_tables, new_tables, row_slots,
               sampling: SamplingArrays) -> tuple[jax.Array, Logprobs]:
        """Prefill with context straight into the pool (prefix caching): rows [D * R]
        (R per dp shard, in shard order) of `lengths` new tokens at positions from
        `starts`, attending to the cached prefix in the pages of `prefix_tables` (may
        have no columns) and written into the pages of `new_tables` (shard-local ids;
        `Llama.extend`); `row_slots`: each row's shard-local slot (whose penalty context
        its sampling reads). Returns each row's next token and its `Logprobs`, on
        device."""
        key = (tokens.shape, prefix_tables.shape)
        program = self.extend_compiler.get(key) if self.extend_compiler is not None else None
        if program is None:
            self.counter.note("extend", key)
            program = self.executables.get(("extend", key), self._extend)
        nxt, logprobs, self.k_pool, self.v_pool = program(*self._extend_args(
            tokens, starts, lengths, prefix_tables, new_tables, row_slots, sampling))
        self._ran.add(key)
        return nxt, logprobs

    def _extend_args(self, tokens, starts, lengths, prefix_tables, new_tables, row_slots,
                     sampling):
        p = self.penalties
        return (self.params, self.k_pool, self.v_pool, p.counts, p.prompt, tokens, starts,
                lengths, prefix_tables, new_tables, row_slots, sampling)

    def extend_program(self, tokens, starts, lengths, prefix_tables, new_tables, row_slots,
                       sampling: SamplingArrays) -> Program:
        """The program `extend` dispatches for these inputs' shapes (the decode
        mesh's prefill with a cached prefix)."""
        (rows, t), w = tokens.shape, prefix_tables.shape[1]
        return Program(f"extend_rows{rows}_t{t}_w{w}", self._extend,
                       self._extend_args(tokens, starts, lengths, prefix_tables, new_tables,
                                         row_slots, sampling), self.extend_kernel,
                       self.slot_sharding,
                       note=functools.partial(self.counter.note, "extend",
                                              (tokens.shape, prefix_tables.shape)),
                       install=functools.partial(self.executables.put,
                                                 ("extend", (tokens.shape, prefix_tables.shape))),
                       carried=POOLS_AFTER_PARAMS)

    def start_background_extend(self, keep: KeptExecutables | None = None) -> None:
        """From now on `extend_ready` asks for a program it lacks, compiled on a thread
        of its own (`BackgroundCompiler`), or loaded where `keep` kept it."""
        if keep is not None:
            self.keep = keep
        self.extend_compiler = BackgroundCompiler("extend_background", self.counter)

    def extend_ready(self, rows: int, length: int, width: int) -> bool:
        """Whether `extend` of `rows` x `length` new tokens after `width` prefix pages runs
        without compiling first, and not for the first time: always before
        `start_background_extend`; else once its background compile (asked for here,
        the first time) is done and the decode thread has run it once (`prime_extend`,
        asked for here once it is compiled). Any thread."""
        if self.extend_compiler is None:
            return True
        key = ((rows, length), (rows, width))
        if not self.extend_compiler.ready(key, lambda: self._lower_extend(rows, length, width)):
            return False
        if key in self._ran:
            return True
        with self._prime_lock:
            self._prime_asked.add(key)
        return False

    def unprimed_extends(self, ask: bool = False) -> list[tuple[int, int, int]]:
        """(rows, new tokens, prefix pages) of each program compiled in the background
        that has not run yet, those asked for (`extend_ready`) first; `ask`: ask for
        them all. Any thread."""
        if self.extend_compiler is None:
            return []
        keys = [k for k in self.extend_compiler.compiled() if k not in self._ran]
        with self._prime_lock:
            if ask:
                self._prime_asked.update(keys)
            keys.sort(key=lambda k: k not in self._prime_asked)
        return [(rows, length, width) for (rows, length), (_, width) in keys]

    def prime_asked(self, rows: int, length: int, width: int) -> bool:
        """Whether the program of this shape was asked to run once (`unprimed_extends`)."""
        with self._prime_lock:
            return ((rows, length), (rows, width)) in self._prime_asked

    def prime_extend(self, rows: int, length: int, width: int) -> None:
        """Run the program of this shape once (compiled in the background), on padding
        rows only: one token each, written to the null page, no prefix, nothing read
        back. An XLA:CPU executable's first run costs several of its later ones (it
        sets up its kernels then), which a request would otherwise pay in its TTFT.
        The decode thread only (the donated pool); dispatched, not waited for."""
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        self.extend(zeros(rows, length), zeros(rows), np.ones(rows, np.int32),
                    zeros(rows, width), zeros(rows, -(-length // self.page_size)), zeros(rows),
                    SamplingArrays.empty(rows))
        with self._prime_lock:
            self._prime_asked.discard(((rows, length), (rows, width)))

    def anticipate_extend(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile these (rows, new tokens, prefix pages) programs of `extend` in the
        background before a request asks for them, in this order, after whatever
        requests ask for (`BackgroundCompiler.anticipate`; after
        `start_background_extend`)."""
        for rows, length, width in shapes:
            self.extend_compiler.anticipate(
                ((rows, length), (rows, width)),
                lambda r=rows, t=length, w=width: self._lower_extend(r, t, w))

    def extend_compiled(self, rows: int, length: int, width: int) -> bool:
        """Whether `extend` of this shape runs a program compiled in the background that
        has run once (before `start_background_extend`: always); asks for nothing."""
        return self.extend_compiler is None or ((rows, length), (rows, width)) in self._ran

    def _lower_extend(self, rows: int, length: int, width: int):
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        program = self.extend_program(
            zeros(rows, length), zeros(rows), zeros(rows), zeros(rows, width),
            zeros(rows, -(-length // self.page_size)), zeros(rows), SamplingArrays.empty(rows))
        return lowering(self.keep, program)

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop the background compiles (`BackgroundCompiler.close`)."""
        if self.extend_compiler is not None:
            self.extend_compiler.close(timeout_s)

    def _assemble(self, shard: int, pages) -> jax.Array:
        """Global [L, D*m, S, K, H] array: `pages` on `shard`, cached zeros elsewhere."""
        l, m = pages.shape[:2]
        shape = (l, self.num_shards * m) + pages.shape[2:]
        pieces = [s.data for s in pages.addressable_shards]
        for d in range(self.num_shards):
            if d == shard:
                continue
            key = (d, pages.shape, pages.dtype)
            if key not in self._zeros_cache:
                self._zeros_cache[key] = jax.device_put(
                    jnp.zeros(pages.shape, pages.dtype), self.shard_sharding(d))
            pieces += [s.data for s in self._zeros_cache[key].addressable_shards]
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(self.mesh, self.pool_spec), pieces)
