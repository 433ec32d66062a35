"""The request state machine under races: a change from another thread lands wholly
before or wholly after a token's change, never in the middle (plain Python, no jax)."""
from __future__ import annotations

import time

from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from tests.support.stop_text import HANG_S, AbortingStopText


def drain(r: Request) -> list:
    events = []
    while not r.events.empty():
        events.append(r.events.get_nowait())
    return events


def decoding(max_tokens: int = 8) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    for state in (State.PREFILLING, State.TRANSFERRING, State.DECODING):
        assert r.transition(state)
    return r


def test_race_abort_during_the_last_token_loses_to_the_finish():
    r = decoding()
    r._stop_text = stop = AbortingStopText(r)
    assert r.append_token(42, time.perf_counter())    # no "illegal transition" here
    stop.thread.join(HANG_S)
    assert stop.aborted == [False]                     # the abort found it finished
    assert r.state is State.FINISHED and r.finish_reason == "stop"
    assert r.abort_reason is None and r.output_ids == [42]
    assert drain(r) == [([42], None), ([], "stop")]


def test_race_abort_before_the_last_token_takes_no_token():
    r = decoding(max_tokens=2)
    assert not r.append_token(7, time.perf_counter())
    assert r.abort("cancelled")
    assert r.append_token(8, time.perf_counter())     # final already: no token, no error
    assert r.state is State.ABORTED and r.finish_reason == "abort"
    assert r.output_ids == [7] and r.abort_reason == "cancelled"
    assert drain(r) == [([7], None), ([], "abort")]
    assert not r.finish("length") and r.state is State.ABORTED


def test_race_finish_then_abort_and_transition_are_no_ops():
    r = decoding()
    assert r.finish("stop")
    assert not r.abort("cancelled") and not r.finish("length")
    assert not r.transition(State.WAITING)             # a loop's move after it: no error
    assert r.state is State.FINISHED and r.finish_reason == "stop"
    assert drain(r) == [([], "stop")]


def test_race_abort_during_a_token_that_does_not_end_it_lands_after_it():
    """An abort blocked while a token is recorded lands right after: the stream gets
    the token, then the abort, and nothing after."""
    r = decoding()
    stop = AbortingStopText(r)
    push = stop.push
    stop.push = lambda ids: push(ids) and False        # the token ends nothing
    r._stop_text = stop
    assert not r.append_token(42, time.perf_counter())
    stop.thread.join(HANG_S)
    assert stop.aborted == [True]
    assert r.state is State.ABORTED and r.abort_reason == "cancelled"
    assert r.append_token(43, time.perf_counter())
    assert r.output_ids == [42]
    assert drain(r) == [([42], None), ([], "abort")]


def prefilled(max_tokens: int = 8) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    assert r.transition(State.PREFILLING)
    return r


def test_a_held_first_token_streams_when_the_request_decodes():
    """Recorded at once (its handoff carries it), streamed and timed only at release."""
    r = prefilled()
    assert not r.append_token(5, 1.0, hold=True)
    assert r.output_ids == [5] and r.timings.token_times == [] and drain(r) == []
    assert r.transition(State.TRANSFERRING) and r.transition(State.DECODING)
    r.release_first_token(2.0)
    r.release_first_token(3.0)                         # nothing held any more: no-op
    assert drain(r) == [([5], None)] and r.timings.token_times == [2.0]
    assert not r.append_token(6, 4.0)
    assert drain(r) == [([6], None)] and r.timings.token_times == [2.0, 4.0]


def test_a_held_first_token_goes_out_before_any_later_event():
    """A re-prefill's next token, a finish or an abort streams the held token first,
    so the stream never loses it."""
    again = prefilled()
    again.append_token(5, 1.0, hold=True)
    assert not again.append_token(6, 2.0)
    assert drain(again) == [([5], None), ([6], None)]
    assert again.timings.token_times == [2.0, 2.0]
    for end in (lambda r: r.abort("cancelled"), lambda r: r.finish("stop")):
        r = prefilled()
        r.append_token(5, 1.0, hold=True)
        assert end(r)
        events = drain(r)
        assert events[0] == ([5], None) and events[-1][1] in ("abort", "stop")
        assert len(events) == 2 and r.timings.token_times and r.output_ids == [5]


def test_a_first_token_that_ends_the_request_is_never_held():
    r = prefilled(max_tokens=1)
    assert r.append_token(5, 1.0, hold=True)
    assert r.state is State.FINISHED and drain(r) == [([5], None), ([], "length")]
