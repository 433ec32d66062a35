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
  restore counts). One that goes through the prefill mesh anyway carries the cached
  hint as `kv_skip_pages`: its handoff leaves those pages out (the decode loop checks
  it still holds them; only pages in the pool are left out: a handoff is inserted,
  never restored).
"""
from __future__ import annotations

import enum
from typing import Callable

from jaxpd.request import Request


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
    `extend_below`: a cached request's rest shorter than this is prefilled there."""

    def __init__(self, *, has_prefill: bool, has_decode: bool, local_prefill: bool,
                 local_prefill_below: int = 0, extend_all: bool = False,
                 cached_tokens: Callable[[Request], tuple[int, int]] | None = None,
                 extend_ready: Callable[[int, int], bool] | None = None,
                 extend_below: int = 0, page_size: int = 16):
        self.has_prefill, self.has_decode = has_prefill, has_decode
        self.local_prefill, self.local_prefill_below = local_prefill, local_prefill_below
        self.extend_all = extend_all
        self.cached_tokens, self.extend_below = cached_tokens, extend_below
        self.extend_ready = extend_ready or (lambda new, cached: True)
        self.page_size = page_size

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
        if cached > 0 and request.num_tokens - cached < self.extend_below and \
                self.extend_ready(request.num_tokens - cached, cached):
            return Inbox.EXTEND
        request.kv_skip_pages = 0 if request.kv_skip_missed else in_pool // self.page_size
        return Inbox.PREFILL
