"""A numpy stand-in for `DecodeRunner` and an in-memory `KVReceiver`, so the decode
loop's admission, transfers, preemption and token bookkeeping are tested in
milliseconds, with every call recorded.

The fake model: the next token is the input token + 1 (mod 1000), so a request's
tokens are a counting sequence from its first token and any mix-up shows.
"""
from __future__ import annotations

import collections
from concurrent import futures

import numpy as np

from jaxpd.transfer.connector import KVHandoff, TransferStats


class FakeRunner:
    """Same interface as `DecodeRunner`: `k_pool`/`v_pool` [L, pages, page_size, K, H]
    (all shards' pages side by side), `shard_sharding`, `insert`, `step`."""

    def __init__(self, num_shards: int, slots_per_shard: int, pages_per_shard: int,
                 page_size: int = 4, num_layers: int = 2, kv_heads: int = 1, head_dim: int = 2):
        shape = (num_layers, num_shards * pages_per_shard, page_size, kv_heads, head_dim)
        self.k_pool = np.zeros(shape, np.float32)
        self.v_pool = np.zeros(shape, np.float32)
        self.pages_per_shard = pages_per_shard
        self.num_shards = num_shards
        self.prev = np.zeros(num_shards * slots_per_shard, np.int32)
        self.inserts: list[tuple[int, list[int]]] = []
        self.steps: list[dict] = []

    def shard_sharding(self, shard: int):
        return ("shard", shard)

    def insert(self, shard: int, page_ids: list[int], k_pages, v_pages) -> None:
        rows = [shard * self.pages_per_shard + p for p in page_ids]
        self.k_pool[:, rows] = np.asarray(k_pages)[:, :len(rows)]   # then padding pages
        self.v_pool[:, rows] = np.asarray(v_pages)[:, :len(rows)]
        self.inserts.append((shard, list(page_ids)))

    def step(self, host_tokens, fed_from_host, positions, block_tables, sampling, rows):
        per = len(self.prev) // self.num_shards
        slots = np.array([(i // (len(rows) // self.num_shards)) * per + r
                          for i, r in enumerate(rows)])       # padding rows: r == per
        real = rows < per
        held = np.where(real, slots, 0)
        tokens = np.where(fed_from_host, host_tokens, self.prev[held])
        self.steps.append({"tokens": tokens.copy(), "positions": positions.copy(),
                           "width": block_tables.shape[1], "rows": len(rows)})
        nxt = (tokens + 1) % 1000
        self.prev[slots[real]] = nxt[real]
        return nxt, None                        # no log-probabilities: none asked here


class FakeReceiver:
    """A `KVReceiver` whose handoffs the test pushes; `place` returns the pages as they
    are, on the thread that calls it. Records what was placed and discarded."""

    def __init__(self):
        self.queue: collections.deque[KVHandoff] = collections.deque()
        self.placed: list[KVHandoff] = []
        self.discarded: list[KVHandoff] = []

    def push(self, handoff: KVHandoff) -> None:
        self.queue.append(handoff)

    def receive(self, timeout):
        return self.queue.popleft() if self.queue else None

    def place(self, handoff: KVHandoff, sharding):
        self.placed.append(handoff)
        return handoff.k, handoff.v, TransferStats(handoff.num_bytes, 0.001)

    def discard(self, handoff: KVHandoff) -> None:
        self.discarded.append(handoff)

    def counts(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class InlineExecutor(futures.Executor):
    """Runs each submitted call at once, on the caller's thread: pages are placed the
    moment a transfer starts, so the loop's decisions are deterministic."""

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        f: futures.Future = futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 -- delivered through the future, as a pool would
            f.set_exception(e)
        return f


def pages(num_layers: int, num_pages: int, value: float, page_size: int = 4) -> np.ndarray:
    """[L, P, page_size, 1, 2] pages filled with `value` (to find them in the pool)."""
    return np.full((num_layers, num_pages, page_size, 1, 2), value, np.float32)
