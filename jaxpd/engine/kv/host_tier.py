"""`HostTier`: a pool's prefix cache continued in host memory (the decode pool's, and
the prefill mesh's own, `PrefillCache`, whose one pool is shard 0).

When a shard's allocator evicts published pages (`PageAllocator.on_evict`), their K
and V are copied off the pool by one warmed-up program (`DecodeRunner.offload`, one
per padded page count, as a handoff pads them), dispatched before any program that
can write those pages again; the copies are read back and stored in a `HostStore`
(LRU by bytes, a checksum per page) on a later loop turn, once they are done. A page
the store already holds is not copied again.

A request whose prefix continues past what its shard holds, in pages the store holds,
gets those pages back (`fetch`, then `restore` into the slot's own pages): one host to
device transfer and one warmed-up insert program, instead of computing them. The store
hands out only pages whose bytes match their checksum; the first that does not ends
the run, and the rest of the request is computed as usual.

Only the decode thread calls `evicted`, `settle`, `fetch` and `restore`; `restorable`
(a routing hint) may be called from any thread.
"""
from __future__ import annotations

import jax
import numpy as np

from typing import Protocol

from jaxpd.engine.kv.host_store import HostStore
from jaxpd.sizes import coarse_ceil, coarse_sizes
from jaxpd.stats import StatsCounter


class PagePool(Protocol):
    """What a host tier needs of a pool's owner (`DecodeRunner`, `PrefillCache`)."""
    k_pool: jax.Array
    v_pool: jax.Array

    def offload(self, shard: int, page_ids: list[int]) -> tuple[jax.Array, jax.Array]: ...

    def insert(self, shard: int, page_ids: list[int], k_pages, v_pages) -> None: ...

    def pages_shape(self, m: int) -> tuple[int, ...]: ...

    def shard_sharding(self, shard: int) -> jax.sharding.Sharding: ...


class HostTier:
    """`runner`'s pool, `store`'s bytes; at most `max_pages` pages move per program
    (a slot's pages: the padded counts warm-up compiles are `sizes()`). Its counts go
    to `stats` as `{counts}_stored_pages`, `_restored_pages` and `_corrupt_pages`."""

    def __init__(self, runner: PagePool, store: HostStore, max_pages: int,
                 stats: StatsCounter, counts: str = "host_tier"):
        self.runner, self.store, self.max_pages, self.stats = runner, store, max_pages, stats
        self._names = {kind: f"{counts}_{kind}_pages" for kind in ("stored", "restored",
                                                                    "corrupt")}
        # Copies dispatched, not yet read back: (hashes, k, v), k and v [L, m, S, K, H].
        self._pending: list[tuple[list[bytes], jax.Array, jax.Array]] = []

    def sizes(self) -> list[int]:
        """Every padded page count `offload` and `restore` run with (warm-up's)."""
        return coarse_sizes(self.max_pages)

    def evicted(self, shard: int, pairs: list[tuple[int, bytes]]) -> None:
        """`shard`'s allocator just evicted these (page, hash) pairs: copy off the
        pages the store does not hold yet (dispatched now, read back by `settle`)."""
        todo = [(p, h) for p, h in pairs if not self.store.touch(h)]
        for i in range(0, len(todo), self.max_pages):
            chunk = todo[i:i + self.max_pages]
            k, v = self.runner.offload(shard, [p for p, _ in chunk])
            self._pending.append(([h for _, h in chunk], k, v))

    def settle(self, wait: bool = False) -> None:
        """Store the copies that are done (every one, waiting for them, if `wait`)."""
        if not self._pending:
            return
        keep, stored = [], 0
        for hashes, k, v in self._pending:
            if not wait and not (k.is_ready() and v.is_ready()):
                keep.append((hashes, k, v))
                continue
            k, v = np.asarray(k), np.asarray(v)
            for i, h in enumerate(hashes):
                stored += self.store.put(h, k[:, i], v[:, i])
        self._pending = keep
        self.stats.add(**{self._names["stored"]: stored})

    def restorable(self, hashes: list[bytes]) -> int:
        """Leading pages of `hashes` the store holds or is being copied (a hint: `fetch`
        checks them)."""
        n = self.store.prefix(hashes)
        copying = {h for pending in list(self._pending) for h in pending[0]}
        while n < len(hashes) and (hashes[n] in copying or hashes[n] in self.store):
            n += 1
        return n

    def fetch(self, hashes: list[bytes]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The checked (K, V) of the longest leading run of `hashes` the store holds
        (`HostStore.take`), copies still in flight included."""
        if not hashes:
            return []
        self.settle(wait=True)
        corrupt = self.store.num_corrupt
        pages = self.store.take(hashes)
        self.stats.add(**{self._names["corrupt"]: self.store.num_corrupt - corrupt})
        return pages

    def restore(self, shard: int, page_ids: list[int],
                pages: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Write `fetch`ed pages into `shard`'s pages `page_ids` (one each, in order):
        one transfer onto the shard, one insert program (padded as a handoff is)."""
        n, m = len(page_ids), coarse_ceil(len(page_ids))
        if len(pages) != n:
            raise ValueError(f"restore of {len(pages)} pages into {n} page ids")
        shape = self.runner.pages_shape(m)
        k = np.zeros(shape, self.runner.k_pool.dtype)
        v = np.zeros(shape, self.runner.v_pool.dtype)
        k[:, :n] = np.stack([p[0] for p in pages], axis=1)
        v[:, :n] = np.stack([p[1] for p in pages], axis=1)
        k, v = jax.device_put((k, v), self.runner.shard_sharding(shard))
        self.runner.insert(shard, page_ids, k, v)
        self.stats.add(**{self._names["restored"]: n})

    @property
    def num_pending(self) -> int:
        return len(self._pending)
