"""`BackgroundCompiler`: programs compiled on a thread of their own while the engine
serves.

A prefill with context is one program per (rows, new tokens, prefix width): warming
them all up would take several times the cache-off warm-up and map tens of
thousands of regions of JIT code. After warm-up, a
program the cache has not compiled yet is asked for here (`request`) and the loop
serves its batch another way meanwhile (without the prefix: what the cache-off engine
computes), so nothing waits for a compile and nothing is compiled that traffic never
needs. `get` returns the compiled program once it is ready. A compile that fails is
logged and remembered (`failed`): that shape keeps the fallback.

Programs a workload is likely to reach soon can be asked for ahead of demand
(`anticipate`): they compile when nothing asked for by a batch is waiting, in the
order given, so a program a batch needs waits at most for the one compile in
progress, never behind a queue of guesses.

A compile competes with serving while it runs: on few cores it slows decode steps
while it lasts. The lowest CPU priority for
this thread made it worse (the thread holding the GIL was preempted while the serving
thread waited for it), and a shorter GIL switch interval did not help, so neither is
used: it is a one-off per program shape, and a benchmark settles it (`settle`).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable, Hashable

_log = logging.getLogger(__name__)


# Queue priorities: a program a batch asked for, then one asked for ahead of demand.
_DEMANDED, _ANTICIPATED = 0, 1


class BackgroundCompiler:
    """`name`: what the compiled programs are, for the log and `counter` (a
    `CompileCounter`: each compiled key is noted under `name`)."""

    def __init__(self, name: str, counter):
        self.name, self.counter = name, counter
        self._ready: dict[Hashable, object] = {}
        self._asked: dict[Hashable, int] = {}           # key -> its best priority
        self._started: set[Hashable] = set()
        self.failed: dict[Hashable, str] = {}
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()                 # FIFO within a priority
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def get(self, key: Hashable):
        """The compiled program of `key`, or None if it is not ready."""
        return self._ready.get(key)

    def ready(self, key: Hashable, lower: Callable[[], object]) -> bool:
        """Whether `key` is compiled; if not, ask for it (`request`)."""
        if self.get(key) is not None:
            return True
        self.request(key, lower)
        return False

    def request(self, key: Hashable, lower: Callable[[], object]) -> None:
        """Compile `lower()` (a `jax.stages.Lowered`) for `key` on the compile thread,
        before every program only anticipated, unless it is asked for already (one
        anticipated and not started yet moves ahead)."""
        self._put(key, lower, _DEMANDED)

    def anticipate(self, key: Hashable, lower: Callable[[], object]) -> None:
        """`request`, but after every program asked for with `request`, even later:
        for a program a workload is likely to reach, compiled before it does."""
        self._put(key, lower, _ANTICIPATED)

    def _put(self, key: Hashable, lower: Callable[[], object], priority: int) -> None:
        with self._lock:
            if self._asked.get(key, priority + 1) <= priority or key in self._started:
                return
            self._asked[key] = priority
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"jaxpd-compile-{self.name}")
                self._thread.start()
            self._queue.put((priority, next(self._order), key, lower))

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop the compile thread after the compile in progress (what is queued is
        dropped), and wait up to `timeout_s` for it: a process that exits the ordinary
        way while XLA compiles on a thread dies in C++ (`terminate called after
        throwing`). `timeout_s` 0 abandons the compile in progress: for a caller that
        ends the process with `os._exit`, which runs no C++ teardown."""
        self._closed.set()
        self._queue.put((-1, -1, None, None))
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread() and timeout_s > 0:
            thread.join(timeout_s)

    def compiled(self) -> list[Hashable]:
        """The keys compiled so far, in the order they finished."""
        with self._lock:
            return list(self._ready)

    @property
    def pending(self) -> int:
        """Programs asked for and neither ready nor failed."""
        with self._lock:
            return len(self._asked) - len(self._ready) - len(self.failed)

    def _run(self) -> None:
        while True:
            _, _, key, lower = self._queue.get()
            if key is None or self._closed.is_set():
                return
            with self._lock:
                if key in self._started:         # queued again at a higher priority
                    continue
                self._started.add(key)
            try:
                compiled = lower().compile()
            except Exception as e:             # noqa: BLE001 -- the fallback serves on
                _log.warning("compiling %s %s in the background failed: %s", self.name, key, e)
                with self._lock:
                    self.failed[key] = str(e)
                continue
            self.counter.note(self.name, key)
            with self._lock:
                self._ready[key] = compiled


def compilers(engine) -> list[BackgroundCompiler]:
    """The engine's background compilers that have started (none before warm-up)."""
    cache, runner = engine.prefill_cache, engine.decode_runner
    return [c for c in (cache and cache.compiler, runner and runner.extend_compiler)
            if c is not None]


def settle(engine, timeout_s: float = 300.0) -> dict:
    """Wait until `engine` compiles nothing in the background and the decode mesh has
    run each program it compiled so once (`DecodeRunner.unprimed_extends`, asked for
    here): a benchmark's warm-up, a test. Returns the compiles that failed, by key.
    TimeoutError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    runner = engine.decode_runner

    def busy() -> bool:
        if any(c.pending for c in compilers(engine)):
            return True
        return runner is not None and bool(runner.unprimed_extends(ask=True))
    while busy():
        if time.monotonic() > deadline:
            raise TimeoutError(f"background compiles still pending after {timeout_s:g} s")
        time.sleep(0.05)
    return {k: v for c in compilers(engine) for k, v in c.failed.items()}
