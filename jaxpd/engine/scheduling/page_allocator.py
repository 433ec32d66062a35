"""Page allocator for one dp shard's KV pool, with a prefix cache (plain Python).

Page 0 is the null page (see models/attention.py): never handed out, so the number of
usable pages is `num_pages - 1`.

**Prefix cache.** A full page whose contents are known is *published* under the hash
of its tokens chained to every page before it (`page_hashes`), so equal prefixes map to
equal hashes. Pages are ref-counted: a request that finds its prefix cached *shares*
those pages instead of computing them. A page nobody references keeps its contents in
an LRU, still findable, and is evicted only when `allocate` has no never-cached page
left -- so eviction comes before any preemption (`can_allocate` counts these pages as
free). A page is published only once its tokens' KV is written, and a shared page is
never written again (requests write at positions past their shared prefix), so a hash
always names what the page holds.

Every page is in exactly one of: free (no contents), cached (contents, unreferenced,
in the LRU), used (referenced): `num_used + num_cached_free + num_never_used ==
capacity` (`check`).

**What a worker advertises** (`CacheJournal`): every publish and eviction is noted in
the journal its allocators share, and the worker's heartbeat carries what changed since
the last one (or, after a failed heartbeat or when the router asks, all it holds), so
the router's `PrefixIndex` knows what each worker's caches hold; pages a host tier holds
(`engine.kv.host_store`) are noted and advertised apart, as restorable rather than held.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import struct
import threading
from typing import Callable


class OutOfPages(Exception):
    pass


def prefix_root(model_cfg, dtype: str, page_size: int) -> bytes:
    """Roots the page hashes: model shapes, dtype, page size (one set of weights)."""
    key = f"{model_cfg}|{dtype}|{page_size}".encode()
    return hashlib.blake2b(key, digest_size=16).digest()


def page_hashes(token_ids: list[int], page_size: int, root: bytes) -> list[bytes]:
    """The chained hash of each *full* page of `token_ids`: page i's hash covers
    (page i-1's hash, page i's tokens), page 0's parent is `root` (the model, dtype and
    page size: pools of different models never agree by accident)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        chunk = struct.pack(f"<{page_size}q", *token_ids[start:start + page_size])
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


# Bytes of a page hash a worker advertises: a collision (2^-64 a pair) costs a wrong
# routing guess, which the worker's own cache corrects, never a wrong page.
ADVERTISED_BYTES = 8
# Keys one advertisement carries at most (about 0.7 MB): a larger cache advertises some
# of its pages, which costs routing guesses, never a heartbeat over gRPC's size limit.
ADVERTISED_MAX = 1 << 16


class CacheJournal:
    """The page hashes a worker's prefix caches hold (over all its allocators), and
    their changes since the last `take`: what its heartbeat advertises. The allocators
    note into it from the engine's threads; the heartbeat thread takes from it."""

    def __init__(self, root: bytes):
        self.root = root
        self._lock = threading.Lock()
        self._held: collections.Counter[bytes] = collections.Counter()   # key -> pages
        self._changed: dict[bytes, bool] = {}     # key -> held now, since the last take
        self._host_held: collections.Counter[bytes] = collections.Counter()
        self._host_changed: dict[bytes, bool] = {}
        self._seq = 0
        self._full = True

    def added(self, h: bytes) -> None:
        self._count(self._held, self._changed, h, 1)

    def dropped(self, h: bytes) -> None:
        self._count(self._held, self._changed, h, -1)

    def host_added(self, h: bytes) -> None:
        """A host tier now holds page `h` (restorable into a pool)."""
        self._count(self._host_held, self._host_changed, h, 1)

    def host_dropped(self, h: bytes) -> None:
        self._count(self._host_held, self._host_changed, h, -1)

    def _count(self, held: collections.Counter, changed: dict, h: bytes, delta: int) -> None:
        """One more (or fewer) holder of `h`'s key; a key held by none before or after
        is noted in `changed` as now held or not."""
        key = h[:ADVERTISED_BYTES]
        with self._lock:
            held[key] += delta
            if delta > 0 and held[key] == 1:
                changed[key] = True
            elif delta < 0 and not held[key]:
                del held[key]
                changed[key] = False

    def take(self) -> dict:
        """The next advertisement: {"root", "seq", "full", "add", "drop"}, and
        "host_add", "host_drop" when pages a host tier holds changed; a full one lists
        the held keys in "add" and "host_add" (at most `ADVERTISED_MAX` each) and
        replaces what the router knew. More changes than that since the last one make it a full
        one."""
        with self._lock:
            self._seq += 1
            if max(len(self._changed), len(self._host_changed)) > ADVERTISED_MAX:
                self._full = True
            if self._full:
                add, drop = list(itertools.islice(self._held, ADVERTISED_MAX)), []
                host_add = list(itertools.islice(self._host_held, ADVERTISED_MAX))
                host_drop = []
            else:
                add = [k for k, held in self._changed.items() if held]
                drop = [k for k, held in self._changed.items() if not held]
                host_add = [k for k, held in self._host_changed.items() if held]
                host_drop = [k for k, held in self._host_changed.items() if not held]
            msg = {"root": self.root, "seq": self._seq, "full": self._full, "add": add,
                   "drop": drop}
            if host_add or host_drop:           # absent: no host tier pages, or no change
                msg.update(host_add=host_add, host_drop=host_drop)
            self._changed.clear()
            self._host_changed.clear()
            self._full = False
            return msg

    def resync(self) -> None:
        """The last advertisement may not have arrived: send everything next time."""
        with self._lock:
            self._full = True


class PageAllocator:
    """`on_evict`: told, at the end of each `allocate` that evicted cached pages, which
    (page, hash) pairs it evicted -- before anything can write the pages again, since
    the caller writes them only after `allocate` returns (a host tier copies them out).
    A cache reset (`drop_cached`) tells nobody."""

    def __init__(self, num_pages: int, journal: CacheJournal | None = None,
                 on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.journal, self.on_evict = journal, on_evict
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs: dict[int, int] = {}                    # used page -> references
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._hash_of: dict[int, bytes] = {}               # published page -> its hash
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: never-used ones and cached unreferenced ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Pages whose contents are published (used or not)."""
        return len(self._hash_of)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def refs(self, page: int) -> int:
        """References held to `page` (0: free or cached)."""
        return self._refs.get(page, 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` pages for new contents, each with one reference; evicts the least
        recently used cached pages when no never-used page is left."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages, evicted = [], []
        for _ in range(n):
            if not self._free:
                evicted.append(self._evict_one())
            p = self._free.pop()
            self._refs[p] = 1
            pages.append(p)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference of each page; an unreferenced published page stays cached.
        `pages` are one request's in prefix order: they enter the LRU last page first,
        so a prefix is evicted from its tail and what stays of it is still findable
        (`cached_prefix` stops at the first missing page: a head evicted first would
        leave the rest cached but unreachable)."""
        for p in reversed(pages):
            if p not in self._refs:
                raise ValueError(f"page {p} freed but not allocated (double free?)")
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            del self._refs[p]
            if p in self._hash_of:
                self._lru[p] = None
            else:
                self._free.append(p)

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The pages holding the longest cached prefix of `hashes` (no reference taken)."""
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def share(self, pages: list[int]) -> None:
        """Take a reference to each of these published pages (found by `cached_prefix`)."""
        for p in pages:
            if p not in self._hash_of:
                raise ValueError(f"page {p} is not cached: it cannot be shared")
            if p in self._lru:
                del self._lru[p]
                self._refs[p] = 1
            else:
                self._refs[p] += 1

    def publish(self, page: int, h: bytes) -> bool:
        """Make the used `page`, whose KV now holds the tokens `h` names, findable.
        False if another page already holds them (this one stays private)."""
        if page not in self._refs:
            raise ValueError(f"page {page} is not in use: only written pages are published")
        if page in self._hash_of:
            return self._hash_of[page] == h
        if h in self._page_of:
            return False
        self._hash_of[page] = h
        self._page_of[h] = page
        if self.journal is not None:
            self.journal.added(h)
        return True

    def drop_cached(self) -> int:
        """Evict every cached page nobody uses (a cache reset); how many there were."""
        n = len(self._lru)
        while self._lru:
            self._evict_one()
        return n

    def _evict_one(self) -> tuple[int, bytes]:
        p, _ = self._lru.popitem(last=False)
        h = self._hash_of.pop(p)
        del self._page_of[h]
        if self.journal is not None:
            self.journal.dropped(h)
        self._free.append(p)
        self.num_evictions += 1
        return p, h

    def check(self) -> None:
        """Assert the accounting (tests): every page in exactly one state."""
        free, cached, used = set(self._free), set(self._lru), set(self._refs)
        assert not (free & cached or free & used or cached & used), "a page in two states"
        assert len(free) + len(cached) + len(used) == self.capacity, (
            f"{len(free)} free + {len(cached)} cached + {len(used)} used != {self.capacity}")
        assert cached <= set(self._hash_of), "an unpublished page in the LRU"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)
