"""`HostStore`: full prefix pages kept in host memory after their pool evicted them.

A bounded map from a page's content hash (the prefix cache's chained hash,
`page_allocator.page_hashes`) to that page's K and V bytes, least recently used first
out, bounded by bytes. Each entry keeps a crc32 of its bytes, taken when it is stored
and checked when it is handed out: an entry whose bytes no longer match is never handed
out -- it is dropped and counted (`num_corrupt`), and the caller computes that page
instead. Plain Python and numpy (no jax); thread-safe: the decode thread stores and
takes, the submitting threads ask how much of a prefix it holds.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import zlib

import numpy as np

from jaxpd.engine.scheduling.page_allocator import CacheJournal


def checksum(k: np.ndarray, v: np.ndarray) -> int:
    """crc32 over the bytes of a page's K then V."""
    return zlib.crc32(memoryview(np.ascontiguousarray(v)).cast("B"),
                      zlib.crc32(memoryview(np.ascontiguousarray(k)).cast("B")))


@dataclasses.dataclass
class _Entry:
    k: np.ndarray
    v: np.ndarray
    crc: int

    @property
    def num_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostStore:
    """At most `capacity_bytes` of pages (K and V together), keyed by content hash;
    `journal`: where pages stored and dropped are noted for the router."""

    def __init__(self, capacity_bytes: int, journal: CacheJournal | None = None):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes, self.journal = capacity_bytes, journal
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_stored = 0        # pages put (a page already held is only touched)
        self.num_evicted = 0       # pages dropped for room
        self.num_corrupt = 0       # pages refused on take: their bytes did not match

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._entries

    def put(self, h: bytes, k: np.ndarray, v: np.ndarray) -> bool:
        """Keep page `h`'s K and V (copied: the caller's arrays stay theirs), evicting
        the least recently used pages until it fits. A page already held is only made
        most recently used; one larger than the whole store is not kept. Whether `h`
        is held after the call."""
        k, v = np.array(k, copy=True), np.array(v, copy=True)
        entry = _Entry(k, v, checksum(k, v))
        with self._lock:
            if h in self._entries:
                self._entries.move_to_end(h)
                return True
            if entry.num_bytes > self.capacity_bytes:
                return False
            while self.num_bytes + entry.num_bytes > self.capacity_bytes:
                old_h, old = self._entries.popitem(last=False)
                self._dropped(old_h, old)
                self.num_evicted += 1
            self._entries[h] = entry
            self.num_bytes += entry.num_bytes
            self.num_stored += 1
            if self.journal is not None:
                self.journal.host_added(h)
            return True

    def _dropped(self, h: bytes, entry: _Entry) -> None:
        self.num_bytes -= entry.num_bytes
        if self.journal is not None:
            self.journal.host_dropped(h)

    def touch(self, h: bytes) -> bool:
        """Make `h` most recently used; whether it is held."""
        with self._lock:
            if h not in self._entries:
                return False
            self._entries.move_to_end(h)
            return True

    def prefix(self, hashes: list[bytes]) -> int:
        """How many leading pages of `hashes` are held (not checked: `take` checks)."""
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in self._entries:
                n += 1
            return n

    def take(self, hashes: list[bytes]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (K, V) of the longest leading run of `hashes` held with bytes that match
        their checksum, most recently used now; they stay held. The first entry whose
        bytes do not match ends the run: it is dropped and counted in `num_corrupt`.
        The arrays are the store's own: read them (a restore copies them), never write."""
        out = []
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None:
                    break
                if checksum(entry.k, entry.v) != entry.crc:
                    del self._entries[h]
                    self._dropped(h, entry)
                    self.num_corrupt += 1
                    break
                self._entries.move_to_end(h)
                out.append((entry.k, entry.v))
        return out

    def check(self) -> None:
        """Assert the accounting (tests): bytes held match the entries, within bounds."""
        with self._lock:
            held = sum(e.num_bytes for e in self._entries.values())
            assert held == self.num_bytes, (held, self.num_bytes)
            assert self.num_bytes <= self.capacity_bytes, (self.num_bytes, self.capacity_bytes)
