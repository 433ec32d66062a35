"""`Requests`: the engine's live requests by id, and the queues into its prefill loops.

Every way a request enters or re-enters the engine goes through here: `submit` (a new
request; admission control), `register` (a decode-only process: a request whose KV is
prefilled elsewhere), `resolve` (the request a handoff belongs to), `resubmit` (it was
preempted, or its transfer failed: prefill it again), `handed_off` (a prefill-only
process: it now lives on the decode side). The loops hold this one object instead of
callbacks into the engine. Plain Python; thread-safe.

Every request that comes in is checked against this engine's own `Limits` with
`jaxpd.validation` (the front ends' checks): one that arrives from a peer beyond them
(a router with a larger max_model_len, a forged RPC) is refused here with a
`ValueError` naming the field, before a loop could choke on it. A handoff from another
process resolves only to a request registered here first (the router's `Decode`
always registers before it asks for the prefill); one for an id nobody registered is
refused, so a peer cannot make this engine decode a request of its own invention.
"""
from __future__ import annotations

import dataclasses
import queue
import secrets
import threading
from typing import Any, Callable

from jaxpd.errors import QueueFull
from jaxpd.request import Request, State
from jaxpd.stats import StatsCounter
from jaxpd.validation import check_request, check_request_id


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request must fit here (the engine's config and model)."""
    vocab_size: int
    max_prompt_len: int
    max_model_len: int


# The states a request is sent back to prefill from (`Requests.resubmit`).
_GOES_BACK = (State.PREFILLING, State.TRANSFERRING, State.DECODING)


class Requests:
    """`has_decode` False: the decode side is another process (handoffs carry the wire
    form; a handed-off request is forgotten here). `local_prefill_below`: prompts
    shorter than this prefill on the decode mesh, when it has a prefill loop there.

    `cached_tokens` (prefix caching on): how many of a request's tokens the decode mesh
    holds cached, as (in its pool, in its pool or its host tier) (a hint read from
    another thread; the decode loop decides for real).
    Then every request the decode mesh prefills goes to `extend_inbox` (prefilled into
    its slot with context, `ExtendLoop`); else the short ones, and one whose prefix is cached there
    and whose uncached rest is below `extend_below` tokens: a follow-up turn costs its
    new tokens, not a trip through the prefill mesh. One that goes through the prefill
    mesh anyway carries the hint as `kv_skip_pages` (of `page_size` tokens): its
    handoff leaves those pages out (the decode loop checks it still holds them; only
    pages in the pool are left out: a handoff is inserted, never restored).
    `extend_all`: every request goes to `extend_inbox` (colocated with the cache or
    with chunks, or a decode-only process with the cache).
    """

    def __init__(self, stats: StatsCounter, max_queued: int, limits: Limits, *,
                 has_prefill: bool, has_decode: bool, has_local_prefill: bool,
                 local_prefill_below: int = 0,
                 cached_tokens: Callable[[Request], tuple[int, int]] | None = None, extend_all: bool = False,
                 extend_below: int = 0, page_size: int = 16):
        self.stats = stats
        self.max_queued = max_queued
        self.limits = limits
        self.remote_decode = not has_decode
        self.has_prefill, self.has_local_prefill = has_prefill, has_local_prefill
        self._local_below = local_prefill_below
        self._cached_tokens, self._extend_below = cached_tokens, extend_below
        self.extends_all = extend_all
        # Whether the decode mesh runs such a rest on compiled programs (`ExtendLoop.
        # ready_for`): a rest whose program compiles in the background goes the long way.
        self.extend_ready: Callable[[int, int], bool] = lambda new, cached: True
        self._page_size = page_size
        self.prefill_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.local_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.extend_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.wake = threading.Event()        # set when an inbox gets work or a request ends
        self._live: dict[str, Request] = {}
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        """An unguessable request id."""
        return f"req-{secrets.token_hex(8)}"

    def check(self, request: Request) -> None:
        """Raise `ValueError` (naming the field) unless `request` fits this engine: its
        id, token ids, lengths and sampling fields, as every front end checks them."""
        c = self.limits
        check_request_id(request.request_id)
        check_request(request.prompt_ids, request.params, vocab_size=c.vocab_size,
                      max_prompt_len=c.max_prompt_len, max_model_len=c.max_model_len,
                      output_ids=request.output_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in request.stop_ids):
            raise ValueError("stop_ids must be token ids")

    def submit(self, request: Request) -> None:
        """Admit a request and queue it for prefill. Raises `QueueFull`, or `ValueError`
        for an id already in flight or a request beyond this engine's limits."""
        self.check(request)
        with self._lock:
            self._prune()
            waiting = sum(r.state is State.WAITING for r in self._live.values())
            if waiting >= self.max_queued:
                raise QueueFull(f"{waiting} requests already wait for prefill "
                                f"(max_queued={self.max_queued})")
            if request.request_id in self._live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._live[request.request_id] = request
        self._route(request)

    def register(self, request: Request) -> None:
        """A mirror (state TRANSFERRING) of a request prefilled in another process:
        the handoff that brings its KV resolves to this object, whose events stream."""
        if request.state is not State.TRANSFERRING:
            raise ValueError(f"register takes a request waiting for its KV, got {request}")
        self.check(request)
        with self._lock:
            self._prune()
            if request.request_id in self._live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._live[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        with self._lock:
            return self._live.get(request_id)

    def resolve(self, request_id: str, payload: Any, remote: bool) -> Request:
        """The request a handoff of `request_id` belongs to: the object itself from this
        process; from another (`remote`), the mirror registered for that id (its wire
        form must name the same id; the mirror, not the wire form, is what decodes).
        Raises `ValueError` saying why a handoff belongs to no request here."""
        if not remote:
            if not isinstance(payload, Request) or payload.request_id != request_id:
                raise ValueError(f"handoff of {request_id!r} carries no request of that id")
            return payload
        check_request_id(request_id)
        if not isinstance(payload, dict) or payload.get("request_id") != request_id:
            raise ValueError(f"handoff of {request_id!r} carries the wire form of another "
                             f"request, or none")
        r = self.get(request_id)
        if r is None:
            raise ValueError(f"no request {request_id!r} is registered here (a remote "
                             f"handoff is taken only for a request announced by register)")
        return r

    def payload_of(self, request: Request, num_tokens: int):
        """What a handoff of `request` carries to the decode side."""
        return request.to_wire(num_tokens=num_tokens) if self.remote_decode else request

    def resubmit(self, request: Request) -> bool:
        """Preempted, or its transfer failed: prefill it again (prompt + output so far).
        False if it is final meanwhile: aborted, or finished (a request preempted by a
        step's plan can finish with the token of the step still in flight, read back
        just after; only the decode thread finishes requests, and it is the caller), or
        sent back already by another thread (`Engine.reprefill` on an RPC thread and the
        decode thread refusing its handoff can race: one of them resubmits it)."""
        if not request.transition_from(_GOES_BACK, State.WAITING):
            return False
        self._route(request)
        return True

    def handed_off(self, request: Request) -> None:
        """Its KV left for another process: the request lives on there."""
        if self.remote_decode:
            with self._lock:
                self._live.pop(request.request_id, None)
            request.events.put(([], "handed_off"))

    def abort(self, request_id: str, reason: str) -> bool:
        """Abort at once; its slot and pages are freed by the loops' next iteration."""
        r = self.get(request_id)
        if r is None or not r.abort(reason):
            return False
        self.stats.add(aborted=1)
        self.wake.set()
        return True

    def abort_all(self, reason: str) -> None:
        with self._lock:
            live = list(self._live.values())
        for r in live:
            if r.abort(reason):
                self.stats.add(aborted=1)

    def num_waiting(self) -> int:
        with self._lock:
            return sum(r.state is State.WAITING for r in self._live.values())

    def all_final(self) -> bool:
        with self._lock:
            return all(r.is_final for r in self._live.values())

    def __len__(self) -> int:
        """Requests not yet known to be over (final ones are forgotten lazily)."""
        with self._lock:
            self._prune()
            return len(self._live)

    def _route(self, request: Request) -> None:
        """To the prefill mesh, or to the decode mesh's own prefill (short prompts, or
        a decode-only process)."""
        local = self.has_local_prefill and (not self.has_prefill
                                     or request.num_tokens < self._local_below)
        if self.extends_all:
            self.extend_inbox.put(request)
        elif self._cached_tokens is None or self.remote_decode:
            # (A prefill-only process: the router's hint came with the request.)
            (self.local_inbox if local else self.prefill_inbox).put(request)
        elif local:
            self.extend_inbox.put(request)
        else:
            # A prefix cached on the decode mesh: the rest prefilled there when short,
            # else on the prefill mesh, whose handoff then leaves the cached pages out.
            in_pool, cached = self._cached_tokens(request)
            if cached > 0 and request.num_tokens - cached < self._extend_below and \
                    self.extend_ready(request.num_tokens - cached, cached):
                self.extend_inbox.put(request)
            else:
                request.kv_skip_pages = 0 if request.kv_skip_missed else in_pool // self._page_size
                self.prefill_inbox.put(request)
        self.wake.set()

    def _prune(self) -> None:
        """Forget final requests (callers hold their own reference)."""
        for k in [k for k, r in self._live.items() if r.is_final]:
            del self._live[k]
