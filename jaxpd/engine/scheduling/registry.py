"""`Requests`: the engine's live requests by id, and the queues into its prefill loops.

Every way a request enters or re-enters the engine goes through here: `submit` (a new
request; admission control), `register` (a decode-only process: a request whose KV is
prefilled elsewhere), `resolve` (the request a handoff belongs to), `resubmit` (it was
preempted, or its transfer failed: prefill it again), `handed_off` (a prefill-only
process: it now lives on the decode side). Which inbox a prompt goes to is `Routing`'s
decision. The loops hold this one object instead of callbacks into the engine. Plain
Python; thread-safe.

Each request is checked once, at the boundary it crosses: a front end's own
(`jaxpd.frontend`) for public input, and `check` here, against this engine's `Limits`
with the same `jaxpd.validation` rules, for a peer's (the role server calls it on every
wire form it decodes), so one beyond them (a router with a larger max_model_len, a
forged RPC) is refused with a `ValueError` naming the field before a loop could choke
on it. `submit` and `register` take requests already checked. A handoff from another
process resolves only to a request registered here first (the router's `Decode`
always registers before it asks for the prefill); one for an id nobody registered is
refused, so a peer cannot make this engine decode a request of its own invention.
"""
from __future__ import annotations

import dataclasses
import queue
import secrets
import threading
from typing import Any

from jaxpd.engine.scheduling.inboxes import Inbox, Routing
from jaxpd.errors import DuplicateRequest, QueueFull
from jaxpd.request import Request, State
from jaxpd.stats import StatsCounter
from jaxpd.validation import check_request, check_request_id, check_token_ids


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request must fit here (the engine's config and model)."""
    vocab_size: int
    max_prompt_len: int
    max_model_len: int


# The states a request is sent back to prefill from (`Requests.resubmit`).
_GOES_BACK = (State.PREFILLING, State.TRANSFERRING, State.DECODING)


class Requests:
    """`routing` decides which inbox a prompt goes to (`engine.scheduling.inboxes`);
    `remote_decode`: the decode side is another process (handoffs carry the wire form;
    a handed-off request is forgotten here)."""

    def __init__(self, stats: StatsCounter, max_queued: int, limits: Limits, routing: Routing,
                 *, remote_decode: bool = False):
        self.stats = stats
        self.max_queued = max_queued
        self.limits = limits
        self.routing = routing
        self.remote_decode = remote_decode
        self.prefill_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.local_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.extend_inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._inboxes = {Inbox.PREFILL: self.prefill_inbox, Inbox.LOCAL: self.local_inbox,
                         Inbox.EXTEND: self.extend_inbox}
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
        check_token_ids(list(request.stop_ids), c.vocab_size, "stop_ids")

    def submit(self, request: Request) -> None:
        """Admit a request and queue it for prefill. Raises `QueueFull`,
        `DuplicateRequest` for an id already in flight. The request is already checked
        (`check`, or the front end's validation)."""
        with self._lock:
            self._prune()
            waiting = sum(r.state is State.WAITING for r in self._live.values())
            if waiting >= self.max_queued:
                raise QueueFull(f"{waiting} requests already wait for prefill "
                                f"(max_queued={self.max_queued})")
            if request.request_id in self._live:
                raise DuplicateRequest(f"request_id {request.request_id!r} is already "
                                       f"in flight")
            self._live[request.request_id] = request
        self._route(request)

    def register(self, request: Request) -> None:
        """A mirror (state TRANSFERRING) of a request prefilled in another process:
        the handoff that brings its KV resolves to this object, whose events stream."""
        if request.state is not State.TRANSFERRING:
            raise ValueError(f"register takes a request waiting for its KV, got {request}")
        with self._lock:
            self._prune()
            if request.request_id in self._live:
                raise DuplicateRequest(f"request_id {request.request_id!r} is already "
                                       f"in flight")
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

    def prefill_instead(self, request: Request) -> None:
        """A waiting request the decode mesh was to prefill with its cached prefix goes
        through the prefill mesh instead (`ExtendLoop`)."""
        self.prefill_inbox.put(request)
        self.wake.set()

    def handed_off(self, request: Request) -> None:
        """Its KV left for another process: the request lives on there."""
        if self.remote_decode:
            with self._lock:
                self._live.pop(request.request_id, None)
            request.events.put(([], "handed_off"))

    def forget(self, request: Request) -> None:
        """It left this engine with its KV (a migration): it lives on elsewhere."""
        with self._lock:
            if self._live.get(request.request_id) is request:
                del self._live[request.request_id]

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
        self._inboxes[self.routing.route(request)].put(request)
        self.wake.set()

    def _prune(self) -> None:
        """Forget final requests (callers hold their own reference)."""
        for k in [k for k, r in self._live.items() if r.is_final]:
            del self._live[k]
