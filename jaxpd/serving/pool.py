"""`ShrinkingThreadPool`: a bounded thread pool whose idle threads exit.

The stdlib `ThreadPoolExecutor` keeps every thread it ever started until shutdown, so a
gRPC server that once served `max_concurrent_rpcs` streams keeps that many threads (and
their stacks) for life. Here a thread starts only when every running thread is busy
(at most `max_workers`), and exits after `idle_s` without work; a burst costs threads
for the burst only.

It subclasses `ThreadPoolExecutor` so that grpc takes it wherever it takes an executor
(a server's pool, `run_in_executor`); it uses none of the parent's machinery.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent import futures


class ShrinkingThreadPool(futures.ThreadPoolExecutor):
    """At most `max_workers` threads named `<thread_name_prefix>-<n>`; a thread idle for
    `idle_s` seconds exits. Work beyond `max_workers` waits in order."""

    def __init__(self, max_workers: int, thread_name_prefix: str, idle_s: float = 30.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s!r}")
        self.max_workers, self.idle_s, self._prefix = max_workers, idle_s, thread_name_prefix
        self._cond = threading.Condition()
        self._work: collections.deque = collections.deque()
        self._threads: set[threading.Thread] = set()
        self._num_idle = 0
        self._num_started = 0
        self._closed = False

    @property
    def num_threads(self) -> int:
        with self._cond:
            return len(self._threads)

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future = futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.append((future, fn, args, kwargs))
            # Each idle thread will take one item: start one more when they are too few.
            if len(self._work) > self._num_idle and len(self._threads) < self.max_workers:
                self._num_started += 1
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"{self._prefix}-{self._num_started}")
                self._threads.add(thread)
                thread.start()
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; queued work still runs unless `cancel_futures`; `wait` joins."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                while self._work:
                    self._work.popleft()[0].cancel()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._num_idle += 1
                deadline = time.monotonic() + self.idle_s
                while not self._work and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._num_idle -= 1
                if not self._work:   # idle too long, or shut down with nothing left
                    self._threads.discard(me)
                    return
                future, fn, args, kwargs = self._work.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:   # noqa: B902 -- handed to the future, as the stdlib does
                future.set_exception(e)
            else:
                future.set_result(result)
            del future, fn, args, kwargs   # drop references before waiting again

