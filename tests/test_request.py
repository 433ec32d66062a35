"""The request state machine under races: a change from another thread lands wholly
before or wholly after a token's change, never in the middle (plain Python, no jax)."""
from __future__ import annotations

import threading
import time

from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams

# Only a safety net so a broken build fails instead of hanging; no test asserts on it.
_HANG_S = 30.0


class WatchedLock:
    """A stand-in for a request's lock that says when another thread has to wait for it
    (`contended`), so a test can hold one thread inside a locked section until the
    other is provably blocked on it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        self.contended.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AbortingStopText:
    """A `StopText` stand-in whose `push` (called while a token is recorded) of token
    `at` (any token when None) aborts the request from another thread (`abort`, by
    default the request's own) and returns only once that abort has either gone
    through or is blocked on the request's lock: the interleaving of an abort landing
    in the middle of a request's last token, forced without sleeping."""

    def __init__(self, request: Request, at: int | None = None, abort=None):
        request._lock = self.lock = WatchedLock()
        self.request, self.at = request, at
        self.abort = abort or request.abort
        self.aborted: list[bool] = []
        self.thread: threading.Thread | None = None

    def push(self, ids) -> bool:
        if self.at is not None and ids[-1] != self.at:
            return False

        def abort():
            self.aborted.append(self.abort("cancelled"))
            self.lock.contended.set()          # done: nothing left to wait for
        self.thread = threading.Thread(target=abort, name="test-abort")
        self.thread.start()
        assert self.lock.contended.wait(_HANG_S), "the abort thread never ran"
        return True                            # the token completes a stop string


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
    stop.thread.join(_HANG_S)
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
    stop.thread.join(_HANG_S)
    assert stop.aborted == [True]
    assert r.state is State.ABORTED and r.abort_reason == "cancelled"
    assert r.append_token(43, time.perf_counter())
    assert r.output_ids == [42]
    assert drain(r) == [([42], None), ([], "abort")]
