"""A decode role whose mesh spans processes (`engine.multihost`): what its leader
publishes for each `DecodeRunner` call, and how a follower replays it.

Plan ops (beside the decode mesh's own prefill, `multihost.prefill.PrefillReplay`):
  step       a decode step's host inputs: tokens, fed_from_host, positions [B], block
             tables [B, W], sampling rows; every process then also dispatches the
             all-gather of its outputs (`_gathered`), the leader's only way to read
             the sampled tokens of a dp shard on another process
  insert     a request's pages into dp shard `shard` at page ids `ids`: from the
             leader's shard `src` by an all-gather, or with the page bytes
  penalties  a slot's penalty context: its prompt and output token ids
  cut        a migration's page take: dp shard `shard`'s pages at `ids`, replicated
             by an all-gather (`gathered_take`) so the leader holds a whole copy of a
             request's KV wherever its shard lies, and its handoff leaves as in one
             process (the decode mesh's own prefill already has a `take` op)

KV inserts: the connector hands the leader a request's pages; the leader places them
on a device of its own (`LeaderDecodeRunner.shard_sharding`) and copies them to the
host. Every process then builds its own devices' blocks of a global pages array
([L, D*m, S, K, H], split over dp like the pool, zeros where it has no pages:
`insert_from_host`) and all dispatch the same insert program. Two routes:
  all-gather  every dp shard lies within one process (decode=D, or DxT with T devices
              per process): the leader's first shard `src` holds the pages, and the
              program all-gathers the blocks over dp and writes block `src` into the
              target shard (`_gather_insert`). The plan carries only page ids, and
              the collectives (gloo, ICI, NCCL) move the bytes, asynchronously.
  plan bytes  a shard spans processes (decode=1x2: tp across them): the page bytes
              ride along in the plan when a follower holds a device of the target
              shard, and its block holds them on every process.
`plan_traffic` measures what the plan costs.

A follower checks every field (shape, dtype, range against its own engine's numbers)
before it acts: a bad one is a PlanError (`multihost.Follower`).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.multihost.plan_channel import PlanChannel, PlanError, pack_array, unpack_array
from jaxpd.engine.multihost.prefill import LeaderPrefillRunner, PrefillReplay
from jaxpd.engine.programs.decode_runner import DecodeRunner
from jaxpd.engine.programs.sampler import SamplingArrays
from jaxpd.engine.scheduling.buckets import decode_batch_sizes
from jaxpd.sharding.compat import shard_map
from jaxpd.sizes import coarse_ceil


def _gathered(runner, tree):
    """`tree` (a step's outputs, split over dp) replicated on every device: a collective
    every process of the mesh dispatches. One jitted identity per runner."""
    program = getattr(runner, "_replicate_program", None)
    if program is None:
        program = jax.jit(lambda x: x, out_shardings=NamedSharding(runner.mesh, P()))
        runner._replicate_program = program
    return program(tree)


def gathered_take(runner, shard: int, page_ids: list[int]):
    """`DecodeRunner.take` on a mesh spanning processes: shard `shard`'s pages at
    `page_ids` ([L, m, S, K, H], padded as a handoff carries them), replicated on every
    device (each process dispatches the take and its all-gather)."""
    return _gathered(runner, runner.take(shard, page_ids))


def _shard_processes(runner, shard: int) -> set[int]:
    """The processes that hold a device of dp shard `shard`."""
    return {d.process_index for d in runner.mesh.devices[shard].flat}


def _gather_insert(runner):
    """The insert program whose pages come from dp shard `src` (an input): each shard
    all-gathers the pages blocks over dp and writes block `src` at its page ids (the
    null page 0 on every shard but the target). One program per page count."""
    program = getattr(runner, "_gather_insert_program", None)
    if program is None:
        def insert(k_pool, v_pool, k_new, v_new, src, page_ids):
            pick = lambda x: jax.lax.all_gather(x, "dp")[src[0]]  # noqa: E731
            return (k_pool.at[:, page_ids].set(pick(k_new)),
                    v_pool.at[:, page_ids].set(pick(v_new)))
        pool, slot = P(None, "dp"), P("dp")
        program = jax.jit(shard_map(insert, mesh=runner.mesh, axis_names={"dp"},
                                    in_specs=(pool, pool, pool, pool, P(), slot),
                                    out_specs=(pool, pool)), donate_argnums=(0, 1),
                          out_shardings=(runner.pool_sharding, runner.pool_sharding))
        runner._gather_insert_program = program
    return program


def gather_source(runner, leader: int = 0) -> int | None:
    """The dp shard that can serve every insert's pages by an all-gather: the first
    held wholly by the leader, when no shard spans processes; else None (the pages
    then travel in the plan to the followers that hold the target shard)."""
    owners = [_shard_processes(runner, s) for s in range(runner.num_shards)]
    if any(len(o) > 1 for o in owners):
        return None
    return next((s for s, o in enumerate(owners) if o == {leader}), None)


def insert_from_host(runner, shard: int, page_ids: list[int], k: np.ndarray | None,
                     v: np.ndarray | None, src: int | None = None) -> None:
    """`DecodeRunner.insert` from host pages [L, n, S, K, H], on a mesh spanning
    processes: each process builds only its own devices' blocks and all dispatch the
    same program. `src` None: the target `shard`'s block holds the pages (k, v may be
    None on a process holding no device of it); else shard `src`'s does (the leader's)
    and an all-gather over dp moves them to `shard` (`_gather_insert`)."""
    n = len(page_ids)
    m = coarse_ceil(n)
    runner.counter.note("insert" if src is None else "insert_gather", m)
    ids = np.zeros((runner.num_shards, m), np.int32)
    ids[shard, :n] = page_ids           # padding rows write the null page 0
    # Each process its own part (a device_put of host data onto a mesh spanning
    # processes would first all-gather it to check that every process passed the same).
    ids = ids.reshape(-1)
    ids = jax.make_array_from_callback(ids.shape, runner.slot_sharding, lambda i: ids[i])
    pool = runner.k_pool
    shape = (pool.shape[0], runner.num_shards * m) + pool.shape[2:]
    sharding = NamedSharding(runner.mesh, runner.pool_spec)

    def build(pages):
        padded = None
        if pages is not None:
            padded = np.zeros((shape[0], m) + shape[2:], pool.dtype)
            padded[:, :n] = pages

        def block(index):
            start = index[1].start or 0
            if start // m != (shard if src is None else src):
                return np.zeros([len(range(*s.indices(d))) for s, d in zip(index, shape)],
                                pool.dtype)
            return padded[(index[0], slice(None)) + tuple(index[2:])]
        return jax.make_array_from_callback(shape, sharding, block)

    if src is None:
        runner.k_pool, runner.v_pool = runner._insert(runner.k_pool, runner.v_pool, build(k),
                                                      build(v), ids)
    else:
        runner.k_pool, runner.v_pool = _gather_insert(runner)(
            runner.k_pool, runner.v_pool, build(k), build(v), np.array([src], np.int32), ids)


def step_message(host_tokens, fed_from_host, positions, block_tables,
                 sampling: SamplingArrays, rows) -> dict:
    """The plan message of one decode step (`DecodeRunner.step`'s host inputs)."""
    return {"op": "step", "tokens": pack_array(host_tokens), "fed": pack_array(fed_from_host),
            "positions": pack_array(positions), "tables": pack_array(block_tables),
            "floats": pack_array(sampling.floats), "ints": pack_array(sampling.ints),
            "rows": pack_array(rows)}


def insert_message(shard: int, page_ids: list[int], k: np.ndarray, v: np.ndarray,
                   with_pages: bool, src: int | None = None) -> dict:
    """The plan message of one page insert: the pages' bytes only `with_pages` (a
    follower holds a device of dp shard `shard` and they do not move by an all-gather
    from the leader's shard `src`)."""
    return {"op": "insert", "shard": shard, "ids": [int(i) for i in page_ids], "src": src,
            "k": pack_array(k) if with_pages else None,
            "v": pack_array(v) if with_pages else None}


class LeaderDecodeRunner:
    """A `DecodeRunner` on a mesh spanning processes whose every program dispatch is
    published first, so followers dispatch the same one. Pages arrive on a device of
    this process (`shard_sharding`), whatever their shard; step outputs and a
    migration's pages (`take`) come back as this process's copy of their all-gather.
    Anything else is the wrapped runner's."""

    def __init__(self, runner, channel: PlanChannel):
        self._runner, self.channel = runner, channel
        self._arrival: NamedSharding | None = None
        self._remote = [_shard_processes(runner, s) - {channel.group.process_id}
                        for s in range(runner.num_shards)]
        self._src = gather_source(runner, channel.group.process_id)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def shard_sharding(self, shard: int) -> NamedSharding:
        """Where a request's pages land before `insert`: this process, for every shard."""
        if self._arrival is None:
            mine = [d for d in self._runner.mesh.devices.flat
                    if d.process_index == jax.process_index()]
            self._arrival = NamedSharding(Mesh(np.array(mine[:1]).reshape(1, 1), ("dp", "tp")),
                                          self._runner.page_spec)
        return self._arrival

    def step(self, host_tokens, fed_from_host, positions, block_tables,
             sampling: SamplingArrays, rows=None):
        r = self._runner
        if rows is None:
            rows = r.every_slot()
        self.channel.publish(step_message(host_tokens, fed_from_host, positions, block_tables,
                                          sampling, rows))
        nxt, logprobs = r.step(host_tokens, fed_from_host, positions, block_tables, sampling,
                               rows)
        out = _gathered(self._runner, (nxt, logprobs if sampling.wants_logprobs else None))
        nxt, kept = jax.tree.map(lambda x: x.addressable_data(0), out)
        return nxt, kept if sampling.wants_logprobs else logprobs

    def insert(self, shard: int, page_ids: list[int], k_pages, v_pages) -> None:
        # Only the real pages travel in the plan; each process pads its own blocks.
        n = len(page_ids)
        k, v = np.asarray(k_pages)[:, :n], np.asarray(v_pages)[:, :n]
        remote = bool(self._remote[shard]) and self._src is None
        self.channel.publish(insert_message(shard, page_ids, k, v, remote, self._src))
        insert_from_host(self._runner, shard, page_ids, k, v, self._src)

    def set_penalties(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.channel.publish({"op": "penalties", "slot": slot,
                              "prompt": pack_array(np.asarray(prompt_ids, np.int32)),
                              "output": pack_array(np.asarray(output_ids, np.int32))})
        self._runner.set_penalties(slot, prompt_ids, output_ids)

    def take(self, shard: int, page_ids: list[int]):
        """A migration's pages (`engine.kv.migration`), as this process's own copy: on one
        of its devices, whatever processes hold the shard."""
        self.channel.publish({"op": "cut", "shard": shard, "ids": [int(i) for i in page_ids]})
        k, v = gathered_take(self._runner, shard, page_ids)
        return k.addressable_data(0), v.addressable_data(0)

    def extend(self, *args, **kwargs):
        raise RuntimeError("prefix caching is not supported on a mesh across processes")


def _int(value, name: str, below: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < below:
        raise PlanError(f"plan field {name}: expected an int in [0, {below})")
    return value


def _ints(msg: dict, name: str, shape: tuple, below: int, max_elements: int = 1 << 24
          ) -> np.ndarray:
    """An int32 array field of `shape` (-1: any length) whose values lie in [0, below)."""
    a = unpack_array(msg.get(name), name, max_elements)
    if a.dtype != np.int32 or a.ndim != len(shape) or any(
            want not in (-1, got) for want, got in zip(shape, a.shape)):
        raise PlanError(f"plan field {name}: expected int32 {list(shape)}, got "
                        f"{a.dtype.name}{list(a.shape)}")
    if a.size and (a.min() < 0 or a.max() >= below):
        raise PlanError(f"plan field {name}: values outside [0, {below})")
    return a


class DecodeReplay:
    """A follower's replay of a `LeaderDecodeRunner`'s calls (and of the decode mesh's
    own prefill, `local`, a `PrefillReplay`) on `runner`, built as the leader's is.
    `config`: the engine's (`EngineConfig`), whose numbers bound every field;
    `process`: this process's index (default: jax's)."""

    def __init__(self, runner, local: PrefillReplay | None, config, vocab: int,
                 process: int | None = None):
        self.runner, self.local = runner, local
        process = jax.process_index() if process is None else process
        self.num_slots = runner.prev_tokens.shape[0]
        self.max_pages, self.vocab = config.pages_per_slot, vocab
        self.max_len = config.max_model_len
        self.max_position = config.pages_per_slot * config.page_size
        self._mine = [process in _shard_processes(runner, s)
                      for s in range(runner.num_shards)]

    def __call__(self, msg: dict) -> None:
        op = msg["op"]
        if op == "step":
            self._step(msg)
        elif op == "insert":
            self._insert(msg)
        elif op == "cut":
            shard, ids = self._pages(msg)
            jax.block_until_ready(gathered_take(self.runner, shard, ids))
        elif op == "penalties":
            slot = _int(msg.get("slot"), "slot", self.num_slots)
            prompt = _ints(msg, "prompt", (-1,), self.vocab, self.max_len)
            output = _ints(msg, "output", (-1,), self.vocab, self.max_len)
            self.runner.set_penalties(slot, prompt.tolist(), output.tolist())
        elif self.local is not None and op in PrefillReplay.OPS:
            self.local(msg)
        else:
            raise PlanError(f"plan op {op!r} is not one a decode leader sends")

    def _step(self, msg: dict) -> None:
        r = self.runner
        rows = _ints(msg, "rows", (-1,), r.slots_per_shard + 1)   # slots_per_shard: padding
        b = rows.shape[0]
        sizes = decode_batch_sizes(r.slots_per_shard,
                                   from_one=getattr(r, "quant_matmul", None) is not None)
        if b not in [s * r.num_shards for s in sizes]:
            raise PlanError(f"plan field rows: {b} rows is not a decode batch size times "
                            f"{r.num_shards} shards")
        tokens = _ints(msg, "tokens", (b,), self.vocab)
        positions = _ints(msg, "positions", (b,), self.max_position)
        tables = _ints(msg, "tables", (b, -1), r.pages_per_shard)
        fed = unpack_array(msg.get("fed"), "fed")
        floats = unpack_array(msg.get("floats"), "floats")
        ints = unpack_array(msg.get("ints"), "ints")
        if not 1 <= tables.shape[1] <= self.max_pages or fed.dtype != np.bool_ or \
                fed.shape != (b,) or floats.shape != (b, 6) or floats.dtype != np.float32 or \
                ints.shape != (b, 4) or ints.dtype != np.int32:
            raise PlanError(f"plan step: tables [{b}, 1..{self.max_pages}], fed bool [{b}], "
                            f"floats f32 [{b}, 6], ints i32 [{b}, 4]")
        sampling = SamplingArrays(floats, ints)
        nxt, logprobs = r.step(tokens, fed, positions, tables, sampling, rows)
        jax.block_until_ready(_gathered(r, (nxt, logprobs if sampling.wants_logprobs
                                            else None)))

    def _pages(self, msg: dict) -> tuple[int, list[int]]:
        """An insert's or a cut's dp shard and page ids, checked."""
        r = self.runner
        shard = _int(msg.get("shard"), "shard", r.num_shards)
        ids = msg.get("ids")
        most = coarse_ceil(self.max_pages)      # warm-up inserts and takes padded counts
        if not isinstance(ids, list) or not 1 <= len(ids) <= most:
            raise PlanError(f"plan field ids: expected 1 to {most} page ids")
        return shard, [_int(i, "ids", r.pages_per_shard) for i in ids]

    def _insert(self, msg: dict) -> None:
        r = self.runner
        shard, ids = self._pages(msg)
        src = msg.get("src")
        if src is not None:                 # the pages come from the leader's shard
            if self._mine[_int(src, "src", r.num_shards)] or \
                    msg.get("k") is not None or msg.get("v") is not None:
                raise PlanError("plan field src: the leader's shard, and no pages with it")
            insert_from_host(r, shard, ids, None, None, src)
            return
        pool = r.k_pool
        shape = (pool.shape[0], len(ids)) + pool.shape[2:]
        pages = []
        for name in ("k", "v"):
            if not self._mine[shard]:
                pages.append(None)          # none of this process's devices: not needed
                continue
            a = unpack_array(msg.get(name), name, int(np.prod(shape)))
            if a.shape != shape or a.dtype != pool.dtype:
                raise PlanError(f"plan field {name}: expected {pool.dtype}{list(shape)}, got "
                                f"{a.dtype.name}{list(a.shape)}")
            pages.append(a)
        insert_from_host(r, shard, ids, *pages)


def lead(runner, plan: PlanChannel | None):
    """`runner`, publishing every program it dispatches when this process leads a mesh
    across processes (`plan` given, process 0); else `runner` itself."""
    if plan is None or not plan.group.is_leader:
        return runner
    leader = LeaderDecodeRunner if isinstance(runner, DecodeRunner) else LeaderPrefillRunner
    return leader(runner, plan)


def replay_for(engine) -> PrefillReplay | DecodeReplay:
    """What a follower of `engine`'s mesh replays the plan on."""
    if engine.decode_runner is None:
        return PrefillReplay(engine.prefill_runner, engine.plan.offers)
    local = engine.local_loop.runner if engine.local_loop is not None else None
    return DecodeReplay(engine.decode_runner, local and PrefillReplay(local), engine.config,
                        engine.model.cfg.vocab_size)
