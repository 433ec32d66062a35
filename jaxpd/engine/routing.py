"""`Routing`: which of the engine's prefill inboxes a prompt goes to. Plain Python.

- `PREFILL`: the prefill mesh (`PrefillLoop`, whole prompts in buckets, then a handoff).
- `LOCAL`: the decode mesh's own `PrefillLoop`, between decode steps (short prompts,
  opt-in: the transfer's fixed cost dominates for them; and every prompt of a
  decode-only process, which re-prefills a request whose transfer failed).
- `EXTEND`: into a slot on the decode mesh with context (`ExtendLoop`): every prompt
  when colocated with the prefix cache or with chunks, or a decode-only process with
  the cache; beside a prefill mesh, a prompt the decode mesh would prefill locally and
  one whose prefix is cached there with a short uncached rest (a follow-up turn costs
  its new tokens, not a trip through the prefill mesh; a prefix its host tier can
  restore counts) -- when that route is the cheaper one now: the decode mesh computes
  its extends one call at a time between steps, so a turn goes there only if the
  tokens queued there plus its rest are at most the tokens queued on the prefill mesh
  plus what the prefill mesh would compute for it (its prompt less what its own cache
  holds). One that goes through the prefill mesh anyway carries the cached hint as
  `kv_skip_pages`: its handoff leaves those pages out (the decode loop checks it still
  holds them; only pages in the pool are left out: a handoff is inserted, never
  restored).
"""
from __future__ import annotations

import enum
import threading
from typing import Callable

from jaxpd.request import Request, State


class Inbox(enum.Enum):
    PREFILL = "prefill"
    LOCAL = "local"
    EXTEND = "extend"


class Routing:
    """`has_prefill`/`has_decode`: this process's meshes; `local_prefill`: the decode
    mesh prefills some prompts itself (all of them without a prefill mesh, else those
    below `local_prefill_below` tokens); `extend_all`: every prompt goes to `EXTEND`.
    `cached_tokens` (decode prefix cache on): how many of a request's tokens the decode
    mesh holds cached, as (in its pool, in its pool or then its host tier), a hint read
    from the submitting thread (the decode loop decides for real); `extend_ready(new, cached)`: whether the decode mesh runs such a rest on
    programs already compiled (one compiling in the background goes the long way);
    `extend_below`: a cached request's rest shorter than this may be prefilled there,
    if that is the cheaper route (`_extend_pays`); `prefill_cached`: how many of a
    request's tokens the prefill mesh's own cache holds (a hint; None: no cache there)."""

    def __init__(self, *, has_prefill: bool, has_decode: bool, local_prefill: bool,
                 local_prefill_below: int = 0, extend_all: bool = False,
                 cached_tokens: Callable[[Request], tuple[int, int]] | None = None,
                 extend_ready: Callable[[int, int], bool] | None = None,
                 extend_below: int = 0, page_size: int = 16,
                 prefill_cached: Callable[[Request], int] | None = None):
        self.has_prefill, self.has_decode = has_prefill, has_decode
        self.local_prefill, self.local_prefill_below = local_prefill, local_prefill_below
        self.extend_all = extend_all
        self.cached_tokens, self.extend_below = cached_tokens, extend_below
        self.extend_ready = extend_ready or (lambda new, cached: True)
        self.prefill_cached = prefill_cached or (lambda request: 0)
        self.page_size = page_size
        # Requests routed beside a prefill mesh and the tokens each is to compute, by
        # inbox; counted while they still wait (`backlog`).
        self._queued: dict[Inbox, dict[int, tuple[Request, int]]] = {
            Inbox.EXTEND: {}, Inbox.PREFILL: {}}
        self._lock = threading.Lock()

    def queued(self, request: Request, inbox: Inbox, tokens: int) -> None:
        """Count `request` (`tokens` to compute) as waiting in `inbox` (and no other)."""
        with self._lock:
            for q in self._queued.values():
                q.pop(id(request), None)
            self._queued[inbox][id(request)] = (request, tokens)

    def backlog(self, inbox: Inbox) -> int:
        """Tokens routed to `inbox` whose requests still wait (not yet computing)."""
        with self._lock:
            q = self._queued[inbox]
            for key in [k for k, (r, _) in q.items() if r.state is not State.WAITING]:
                del q[key]
            return sum(tokens for _, tokens in q.values())

    def _extend_pays(self, request: Request, cached: int) -> bool:
        """Whether the decode mesh reaches `request`'s first token sooner, by tokens to
        compute ahead of it and for it on each route: the extends queued there and its
        rest, against the prompts queued on the prefill mesh and its prompt less what
        the prefill mesh's cache holds (it computes at least the last token)."""
        n = request.num_tokens
        there = n - min(self.prefill_cached(request), n - 1)
        return self.backlog(Inbox.EXTEND) + n - cached <= self.backlog(Inbox.PREFILL) + there

    def route(self, request: Request) -> Inbox:
        """Where `request` is prefilled (it may set `request.kv_skip_pages`)."""
        local = self.local_prefill and (not self.has_prefill
                                        or request.num_tokens < self.local_prefill_below)
        if self.extend_all:
            return Inbox.EXTEND
        if self.cached_tokens is None or not self.has_decode:
            # (A prefill-only process: the router's hint came with the request.)
            return Inbox.LOCAL if local else Inbox.PREFILL
        if local:
            return Inbox.EXTEND
        in_pool, cached = self.cached_tokens(request)
        n = request.num_tokens
        # (Asked last: a program not compiled yet is asked for in the background.)
        if cached > 0 and n - cached < self.extend_below and \
                self._extend_pays(request, cached) and self.extend_ready(n - cached, cached):
            self.queued(request, Inbox.EXTEND, n - cached)
            return Inbox.EXTEND
        request.kv_skip_pages = 0 if request.kv_skip_missed else in_pool // self.page_size
        self.queued(request, Inbox.PREFILL, n - min(self.prefill_cached(request), n - 1))
        return Inbox.PREFILL
