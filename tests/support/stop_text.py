"""A request's lock that says when another thread waits for it, and a `StopText`
stand-in that aborts the request from another thread mid-token: races forced without
sleeping."""
from __future__ import annotations

import threading

from jaxpd.request import Request

# Only a safety net so a broken build fails instead of hanging; no test asserts on it.
HANG_S = 30.0


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
        assert self.lock.contended.wait(HANG_S), "the abort thread never ran"
        return True                            # the token completes a stop string

