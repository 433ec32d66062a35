"""`PrefixIndex`: which decode worker holds which prefixes, as the router sees them.

Prefix-aware routing (issue 15) sends turn N+1 of a conversation to the decode worker
whose prefix cache holds turn N, and lets that worker prefill the short rest itself.
The router learns what each worker holds from what it relayed there: when a request
ends on a worker, the full pages of its prompt and output (but the last token, whose
KV is never written) are recorded under that
worker (the same chained page hashes as the workers' caches, `page_hashes`, rooted
here: only this index compares them). No message is added to the internal plane; the
price is that the index is an estimate -- a worker may have evicted a page since.
An estimate is safe: the worker decides what it really shares, and a page it no
longer holds is computed, never read.

Each worker's entries are bounded (`max_pages`, oldest forgotten first), and a dropped
worker's entries go with it. Plain Python; thread-safe.
"""
from __future__ import annotations

import collections
import threading

from jaxpd.engine.page_allocator import page_hashes

_ROOT = b"jaxpd-router-prefix-index"


class PrefixIndex:
    def __init__(self, page_size: int, max_pages: int = 1 << 16):
        self.page_size, self.max_pages = page_size, max_pages
        self._held: dict[str, collections.OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        return page_hashes(token_ids, self.page_size, _ROOT)

    def record(self, worker: str, token_ids: list[int]) -> None:
        """`worker` now holds the full pages of `token_ids` (most recently used)."""
        hashes = self.hashes(token_ids)
        with self._lock:
            held = self._held.setdefault(worker, collections.OrderedDict())
            for h in hashes:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.max_pages:
                held.popitem(last=False)

    def cached_tokens(self, worker: str, hashes: list[bytes]) -> int:
        """Tokens of the longest prefix of `hashes` that `worker` is believed to hold."""
        with self._lock:
            held = self._held.get(worker, {})
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
        return n * self.page_size

    def forget(self, worker: str) -> None:
        with self._lock:
            self._held.pop(worker, None)
