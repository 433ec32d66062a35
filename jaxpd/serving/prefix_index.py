"""`PrefixIndex`: which worker holds which prefixes, as the router sees them.

Prefix-aware routing sends turn N+1 of a conversation to the decode worker
whose prefix cache holds turn N, and lets that worker prefill the short rest itself;
when the rest goes through a prefill worker, the one whose own cache holds the most of
the prompt is preferred (weighed against its queue).

What a worker holds, the router learns two ways:
- **Advertised** (the truth, a heartbeat late). A worker with prefix caching sends,
  with each heartbeat, the page hashes its caches published and evicted since the last
  one (`CacheJournal`: 8 bytes a page, chained from the worker's own root, which the
  advertisement carries), or all of them after a failed heartbeat or when this index
  asks (`advertise` answers False: an advertisement was missed). Nothing is sent per
  request, and an eviction is known within a heartbeat.
- **Relayed** (a belief, immediate). When a request ends on a decode worker, the full
  pages of its prompt and output (but the last token, whose KV is never written) are
  recorded under it; when a prefill worker has prefilled one, the full pages of its
  prompt. A follow-up turn can arrive before the next heartbeat advertises them. Once a
  worker advertises, a belief lasts two of its advertisements (by then the worker has
  said whether it holds those pages), then only the advertised set counts.

A worker's host tier (`engine.kv.host_store`) is advertised apart ("host_add",
"host_drop"): pages it can restore into its pool rather than compute. `cached_tokens`
counts only what the pool holds (a handoff may leave out only those pages);
`restorable_tokens` continues that prefix through the host tier's pages, and the
router weighs both when it picks a decode worker.

Only a worker that has advertised counts: one whose cache is off never advertises, so
the router believes it holds nothing and routes to it by load alone. That is why the
router can keep prefix routing on by default (`RouterConfig.prefix_routing`): it
follows the workers' own choice. A worker with the cache on advertises with its first
registration, before any request can be routed to it.

Either can be stale or wrong (a worker may evict a page meanwhile, a peer may lie):
that is safe, because the worker decides what it really shares, and a page it does not
hold is computed, never read. An advertisement is a peer's word: `advertise` checks
every field (ValueError naming it) and bounds its size.

Each worker's beliefs are bounded (`max_pages`, oldest forgotten first), its advertised
set by `MAX_ADVERTISED`, and a dropped worker's entries go with it. Plain Python;
thread-safe.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

from jaxpd.engine.scheduling.page_allocator import ADVERTISED_BYTES, page_hashes

_ROOT = b"jaxpd-router-prefix-index"      # beliefs of a worker that never advertised
MAX_ADVERTISED = 1 << 20                  # keys one worker may hold here (8 MiB)
BELIEF_ADVERTISEMENTS = 2                 # a belief outlives this many advertisements


@dataclasses.dataclass
class _Held:
    root: bytes = _ROOT
    seq: int = 0                          # last advertisement applied (0: none)
    adverts: int = 0                      # advertisements applied
    advertised: set = dataclasses.field(default_factory=set)
    host: set = dataclasses.field(default_factory=set)     # keys in its host tier
    beliefs: collections.OrderedDict = dataclasses.field(
        default_factory=collections.OrderedDict)       # key -> `adverts` when recorded


class PrefixQuery:
    """One request's page hashes, computed once per root they are asked under."""

    def __init__(self, token_ids: list[int], page_size: int):
        self.token_ids, self.page_size = token_ids, page_size
        self._keys: dict[bytes, list[bytes]] = {}

    def keys(self, root: bytes) -> list[bytes]:
        if root not in self._keys:
            self._keys[root] = [h[:ADVERTISED_BYTES] for h in
                                page_hashes(self.token_ids, self.page_size, root)]
        return self._keys[root]


def check_advertisement(msg) -> dict:
    """A worker's advertisement, every field checked; ValueError naming the field."""
    if not isinstance(msg, dict):
        raise ValueError(f"prefix must be a map, got {type(msg).__name__}")
    root, seq, full = msg.get("root"), msg.get("seq"), msg.get("full")
    if not isinstance(root, bytes) or not 1 <= len(root) <= 64:
        raise ValueError("prefix.root must be 1 to 64 bytes")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 2**62:
        raise ValueError(f"prefix.seq must be a positive integer, got {seq!r}")
    if not isinstance(full, bool):
        raise ValueError(f"prefix.full must be a boolean, got {full!r}")
    lists = {}
    for name in ("add", "drop", "host_add", "host_drop"):
        keys = msg.get(name, [] if name.startswith("host_") else None)
        if not isinstance(keys, list) or len(keys) > MAX_ADVERTISED:
            raise ValueError(f"prefix.{name} must be a list of at most {MAX_ADVERTISED} keys")
        if not all(isinstance(k, bytes) and len(k) == ADVERTISED_BYTES for k in keys):
            raise ValueError(f"prefix.{name} must hold {ADVERTISED_BYTES}-byte keys")
        lists[name] = keys
    return {"root": root, "seq": seq, "full": full, **lists}


class PrefixIndex:
    def __init__(self, page_size: int, max_pages: int = 1 << 16):
        self.page_size, self.max_pages = page_size, max_pages
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def query(self, token_ids: list[int]) -> PrefixQuery:
        return PrefixQuery(token_ids, self.page_size)

    def record(self, worker: str, token_ids: list[int]) -> None:
        """`worker` now holds the full pages of `token_ids` (most recently used)."""
        with self._lock:
            held = self._held.setdefault(worker, _Held())
            root = held.root
        keys = PrefixQuery(token_ids, self.page_size).keys(root)
        with self._lock:
            held = self._held.get(worker)
            if held is None or held.root != root:
                return                            # dropped or re-rooted meanwhile
            for k in keys:
                held.beliefs[k] = held.adverts
                held.beliefs.move_to_end(k)
            while len(held.beliefs) > self.max_pages:
                held.beliefs.popitem(last=False)

    def advertise(self, worker: str, msg) -> bool:
        """Apply `worker`'s advertisement (`CacheJournal.take`). False if it could not
        be applied (a change list that does not follow the last one applied): the
        worker must send everything next time. Raises ValueError on a malformed one."""
        msg = check_advertisement(msg)
        with self._lock:
            held = self._held.setdefault(worker, _Held())
            if msg["full"]:
                if held.root != msg["root"]:
                    held.beliefs.clear()          # recorded under another root
                held.root, held.advertised = msg["root"], set(msg["add"])
                held.host = set(msg["host_add"])
            elif held.seq and msg["seq"] == held.seq + 1 and held.root == msg["root"]:
                held.advertised.difference_update(msg["drop"])
                held.advertised.update(msg["add"])
                held.host.difference_update(msg["host_drop"])
                held.host.update(msg["host_add"])
                if len(held.advertised) > MAX_ADVERTISED or len(held.host) > MAX_ADVERTISED:
                    held.advertised.clear()
                    held.host.clear()
                    held.seq = 0
                    return False
            else:
                held.seq = 0                      # missed one: wait for everything
                return False
            held.seq = msg["seq"]
            held.adverts += 1
            expired = held.adverts - BELIEF_ADVERTISEMENTS
            while held.beliefs and next(iter(held.beliefs.values())) <= expired:
                held.beliefs.popitem(last=False)
        return True

    def cached_tokens(self, worker: str, query: PrefixQuery) -> int:
        """Tokens of the longest prefix of `query` that `worker` is believed to hold."""
        return self._prefix_pages(worker, query, host=False) * self.page_size

    def restorable_tokens(self, worker: str, query: PrefixQuery) -> int:
        """Tokens of the longest prefix of `query` that `worker` holds in its pool or
        can restore from its host tier (the pool's run, continued by host pages)."""
        return self._prefix_pages(worker, query, host=True) * self.page_size

    def _prefix_pages(self, worker: str, query: PrefixQuery, host: bool) -> int:
        with self._lock:
            held = self._held.get(worker)
            if held is None or not held.adverts:
                return 0                          # no cache we know of
            root = held.root
        keys = query.keys(root)
        with self._lock:
            n = 0
            while n < len(keys) and (keys[n] in held.advertised or keys[n] in held.beliefs):
                n += 1
            while host and n < len(keys) and keys[n] in held.host:
                n += 1
        return n

    def forget(self, worker: str) -> None:
        with self._lock:
            self._held.pop(worker, None)
