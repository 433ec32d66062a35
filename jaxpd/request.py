"""A request and its explicit state machine (plain Python, no jax).

    WAITING -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
    any non-final state -> ABORTED (with a reason)
    DECODING / TRANSFERRING -> WAITING      (preempted: recomputed later)
    PREFILLING / TRANSFERRING -> FINISHED   (the first token already ends it)
    WAITING -> FINISHED                     (a router's request: relayed tokens end it)
    DECODING -> TRANSFERRING                (an elastic re-split moves its KV)

Every change of state goes through `_move` (under the request's lock): `transition`
for the loops, `append_token` when a token ends it, `finish`, `abort`. Each of those
makes its whole change -- the token, the stop checks, the move, the events -- in one
hold of the lock, so a change from another thread lands wholly before or wholly after
it. Every request ends in exactly one final state; `abort` or `finish` on a final
request is a no-op that returns False, so racing cancel and completion can neither
double-finish nor raise.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading
import time

from jaxpd.output_sink import SLOW_READER, EventQueue, OutputSink
from jaxpd.sampling_params import SamplingParams
from jaxpd.text import StopText

# (log-probability of the sampled token, ((token id, log-probability), ...) best first)
TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]


def _ints(value, field: str) -> list[int]:
    """A list of plain ints from a peer's wire form (ranges are checked by the engine)."""
    if not isinstance(value, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise ValueError(f"{field} must be a list of integers")
    return list(value)


def _logprob(value, field: str) -> float:
    if not isinstance(value, float) or math.isinf(value):
        raise ValueError(f"{field}: a log-probability must be a finite float or nan, "
                         f"got {value!r}")
    return value


def token_logprobs_from_wire(value, top: int, field: str) -> TokenLogprobs:
    """One token's log-probabilities from a peer, `[logprob, [[id, logprob], ...]]` with
    at most `top` pairs, checked as untrusted input (`ValueError` naming `field`)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2 \
            or not isinstance(value[1], (list, tuple)):
        raise ValueError(f"{field} must be [logprob, [[token id, logprob], ...]]")
    if len(value[1]) > top:
        raise ValueError(f"{field} has {len(value[1])} top log-probabilities, more than "
                         f"the {top} asked for")
    pairs = []
    for pair in value[1]:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{field}: a top log-probability must be [token id, logprob]")
        token = pair[0]
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**31:
            raise ValueError(f"{field}: token id {token!r} is not an integer in [0, 2**31)")
        pairs.append((token, _logprob(pair[1], field)))
    return _logprob(value[0], field), tuple(pairs)


def handoff_logprobs(payload, num_logprobs: int | None) -> TokenLogprobs | None:
    """A prefilled request's first-token log-probabilities, from the prefill side's wire
    form of it (a handoff's payload: a peer's word, checked; ValueError naming the
    field), when the request asked for them."""
    if num_logprobs is None:
        return None
    payload = payload if isinstance(payload, dict) else {}
    return token_logprobs_from_wire(payload.get("next_logprobs"), num_logprobs,
                                    "next_logprobs")


def logprobs_from_wire(value, num_tokens: int, top: int, field: str = "logprobs"
                       ) -> list[TokenLogprobs]:
    """The log-probabilities of `num_tokens` tokens from a peer (see
    `token_logprobs_from_wire`); `ValueError` naming `field`."""
    if not isinstance(value, (list, tuple)) or len(value) != num_tokens:
        raise ValueError(f"{field} must be a list of {num_tokens} tokens' log-probabilities")
    return [token_logprobs_from_wire(x, top, f"{field}[{i}]") for i, x in enumerate(value)]


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


_ALLOWED = {
    # WAITING -> FINISHED: the router's own request waits while the roles work on it;
    # the tokens it relays end it.
    State.WAITING: {State.PREFILLING, State.FINISHED, State.ABORTED},
    # PREFILLING -> DECODING: prefilled into its decode slot (`ExtendLoop`), nothing moves.
    State.PREFILLING: {State.TRANSFERRING, State.DECODING, State.FINISHED, State.WAITING,
                       State.ABORTED},
    State.TRANSFERRING: {State.DECODING, State.FINISHED, State.WAITING, State.ABORTED},
    # DECODING -> TRANSFERRING: an elastic re-split moves its KV to the new decode mesh.
    State.DECODING: {State.TRANSFERRING, State.FINISHED, State.WAITING, State.ABORTED},
}
FINAL = (State.FINISHED, State.ABORTED)


@dataclasses.dataclass
class Timings:
    """Wall-clock stamps (time.perf_counter) and transfer accounting of one request."""
    arrival: float = 0.0
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    kv_ready: float | None = None      # its KV is in a decode slot (this process)
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish: float | None = None
    num_preemptions: int = 0
    local_prefill: bool = False


class Request:
    """One generation request as it moves through the engine.

    `prompt_ids` never changes; after a preemption the prefill input is
    `prompt_ids + output_ids` (recompute), see `prefill_ids`.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), state: State = State.WAITING):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = params.resolved_seed()
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.output_ids: list[int] = []
        self.state = state
        self.finish_reason: str | None = None   # "stop" | "length" | "abort"
        self.abort_reason: str | None = None
        self.timings = Timings(arrival=time.perf_counter())
        # (new ids, finish reason or None) for its stream: the consumer may give it another
        # sink before it is submitted (`jaxpd.output_sink`).
        self.events: OutputSink = EventQueue()
        self._lock = threading.Lock()
        self.destination: str | None = None   # decode peer for its KV (multi-process)
        # Prefix caching: leading full pages its decode side is believed to hold, which
        # its prefill need not send (a hint; the decode side checks it). After one
        # handoff found the hint stale, none again (`kv_skip_missed`).
        self.kv_skip_pages = 0
        self.kv_skip_missed = False
        # Why the migration that was to bring its KV failed, once one did (a decode
        # worker's Decode stream tells the router).
        self.move_failure: str | None = None
        # A first token recorded but not yet streamed (`append_token(hold=True)`).
        self._held: int | None = None
        # Per output token, when params.logprobs is set: (its log-probability, the
        # params.logprobs most likely (token id, log-probability) pairs, best first).
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self._stop_text: StopText | None = None

    def watch_stop_strings(self, tokenizer) -> None:
        """End the request (reason "stop") as soon as its output text contains one of
        params.stop (the engine that samples its tokens calls this). ValueError without
        a tokenizer."""
        if self.params.stop:
            if tokenizer is None:
                raise ValueError("stop: this model has no tokenizer, so no stop strings "
                                 "(use stop_token_ids)")
            self._stop_text = StopText(tokenizer, self.params.stop)
            self._stop_text.push(self.output_ids)

    def to_wire(self, num_tokens: int | None = None) -> dict:
        """Msgpack-able form for another process. `num_tokens`: how many of
        prompt + output the accompanying KV covers (the output beyond it, i.e. the
        first token just sampled, is left for the handoff's `first_token`; its
        log-probabilities, when asked for, travel here as `next_logprobs`)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        output = self.output_ids[:n - len(self.prompt_ids)]
        wire = {
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "output_ids": output,
            "seed": self.seed,
            "stop_ids": sorted(self.stop_ids),
            "params": self.params.to_wire(),
        }
        if self.logprobs is not None and len(self.logprobs) > len(output):
            wire["next_logprobs"] = self.logprobs[len(output)]
        if self.kv_skip_pages:
            wire["kv_skip_pages"] = self.kv_skip_pages
        return wire

    @classmethod
    def from_wire(cls, d: dict, state: State = State.TRANSFERRING) -> "Request":
        """A request from another process: by default a decode-side mirror of one
        prefilled there (its KV is on the way); WAITING to prefill it here.

        `d` is a peer's word: every field's type is checked (`ValueError` naming it),
        the log-probabilities of its output too (one per output token, when its params
        ask for them); whether the ids and lengths fit this engine is `Requests.check`'s
        job."""
        if not isinstance(d, dict):
            raise ValueError(f"request must be a map, got {type(d).__name__}")
        wire = d.get("params")
        if not isinstance(wire, dict):
            raise ValueError("params must be a map")
        try:
            params = SamplingParams(**{**wire, "stop_token_ids": tuple(
                _ints(wire.get("stop_token_ids", ()), "params.stop_token_ids"))})
        except (TypeError, ValueError) as e:
            raise ValueError(f"params: {e}") from None
        request_id = d.get("request_id")
        if not isinstance(request_id, str):
            raise ValueError("request_id must be a string")
        seed = d.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        r = cls(request_id, _ints(d.get("prompt_ids"), "prompt_ids"), params, state=state)
        r.seed = seed
        r.stop_ids = frozenset(_ints(d.get("stop_ids"), "stop_ids"))
        r.output_ids = _ints(d.get("output_ids"), "output_ids")
        skip = d.get("kv_skip_pages", 0)
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0 or (
                skip and skip >= len(r.prefill_ids)):
            raise ValueError(f"kv_skip_pages must be an integer in [0, tokens), got {skip!r}")
        r.kv_skip_pages = skip
        if params.logprobs is not None:
            # The output's log-probabilities stay with whoever already streamed it (a
            # failover or recompute would otherwise resend them all): placeholders here.
            r.logprobs = [(math.nan, ())] * len(r.output_ids)
        return r

    def __repr__(self):
        return f"Request({self.request_id}, {self.state.value}, {len(self.output_ids)} out)"

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_final(self) -> bool:
        return self.state in FINAL

    def transition(self, new: State) -> bool:
        """Move to `new`; False (no change) if the request is final meanwhile: an abort
        from another thread wins any race with a worker's transition."""
        with self._lock:
            if self.state in FINAL:
                return False
            self._move(new)
            return True

    def transition_from(self, expected: tuple[State, ...], new: State) -> bool:
        """Move to `new` only from one of `expected`; False (no change) otherwise: another
        thread moved it meanwhile (an abort, or `Engine.reprefill` sending it back to
        prefill) and that move stands."""
        with self._lock:
            if self.state not in expected:
                return False
            self._move(new)
            return True

    def _move(self, new: State) -> None:
        """The one place a state changes (caller holds the lock)."""
        if new not in _ALLOWED.get(self.state, ()):
            raise RuntimeError(f"request {self.request_id}: illegal transition "
                               f"{self.state.value} -> {new.value}")
        self.state = new

    def append_token(self, token: int, now: float,
                     logprobs: TokenLogprobs | None = None, hold: bool = False) -> bool:
        """Record one generated token (and, when asked for, its log-probabilities); True
        when it ends the request (and it is finished). A request that is already final
        (e.g. aborted meanwhile) takes no more tokens and answers True.

        `hold`: a prefill's first token whose KV still has to reach the decode side.
        It is recorded (the handoff carries it) but streamed, and timed, only by
        `release_first_token` once the request decodes, so the stream's second token
        never waits for the transfer; any later token, finish or abort streams it
        first. A token that ends the request is never held.

        The token, the stop checks and the move to FINISHED, with their events, are one
        step under the request's lock: an `abort` from another thread lands before it
        (no token is taken) or after it (the abort is a no-op), and a stream sees the
        events in the order the changes happened. A sink past its bound (a slow reader)
        aborts the request here, with `SLOW_READER`."""
        with self._lock:
            if self.state in FINAL:
                return True
            if not self._stream_held(now):
                return True
            self.output_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(logprobs if logprobs is not None else (float("nan"), ()))
            reason = None
            if token in self.stop_ids:
                reason = "stop"
            elif self._stop_text is not None and self._stop_text.push([token]):
                reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                reason = "length"
            if hold and reason is None:
                self._held = token
                return False
            self.timings.token_times.append(now)
            if not self.events.put(([token], None)):
                self.abort_reason = SLOW_READER
                self._end(State.ABORTED, "abort", now)
                return True
            if reason is None:
                return False
            self._end(State.FINISHED, reason, now)
            return True

    def release_first_token(self, now: float) -> None:
        """Stream the first token `append_token` held: the request decodes now."""
        with self._lock:
            if self.state not in FINAL:
                self._stream_held(now)

    def _stream_held(self, now: float) -> bool:
        """Stream a held token (caller holds the lock); False when the sink refused it
        and the request is aborted as a slow reader."""
        if self._held is None:
            return True
        token, self._held = self._held, None
        self.timings.token_times.append(now)
        if self.events.put(([token], None)):
            return True
        self.abort_reason = SLOW_READER
        self._end(State.ABORTED, "abort", now)
        return False

    def finish(self, reason: str) -> bool:
        """End the request as its sampler said when the checks here cannot see why
        (a decode worker matched a stop string): True if this call finished it, False
        (no change) if it was final already."""
        if reason not in ("stop", "length"):
            raise ValueError(f"finish reason must be 'stop' or 'length', got {reason!r}")
        with self._lock:
            if self.state in FINAL:
                return False
            self._end(State.FINISHED, reason, time.perf_counter())
            return True

    def abort(self, reason: str) -> bool:
        """Move to ABORTED unless already final. Returns whether this call aborted it:
        False (no change) when a finish or another abort got there first."""
        with self._lock:
            if self.state in FINAL:
                return False
            self.abort_reason = reason
            self._end(State.ABORTED, "abort", time.perf_counter())
            return True

    def _end(self, final: State, reason: str, now: float) -> None:
        """Move to a final state and tell the stream (caller holds the lock, so the
        final event is the last one the stream gets; a held token goes before it)."""
        if self._held is not None:
            token, self._held = self._held, None
            self.timings.token_times.append(now)
            self.events.put(([token], None))
        self._move(final)
        self.finish_reason = reason
        self.timings.finish = now
        self.events.put(([], reason))
