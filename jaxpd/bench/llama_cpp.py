"""The llama.cpp baseline (`--compare llama_cpp`): the same requests through
`llama-cpp-python` on the same GGUF file.

One sequence at a time, the way a llama.cpp `Llama` object serves: requests in arrival
order, each started when it has arrived and the one before it has finished, prompt
evaluated, then greedy tokens (`temp=0`) until its output length, EOS ignored (the
engine's `ignore_eos`: the same work). Each token is stamped when the generator yields
it, so TTFT includes the prompt's evaluation and TPOT is the per-token decode time.
Threads: `n_threads` (default: the CPUs this process may run on).

The optional extra `llama-cpp` installs it; built from source without native CPU
flags, `CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python` (README).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Callable, Sequence

from jaxpd.bench.driver import BenchRequest, RunResult, run_duration, sleep_until
from jaxpd.metrics import RequestTimeline

NAME = "llama_cpp"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppBackend:
    """llama.cpp serving one request at a time from a GGUF file."""

    name = NAME

    def __init__(self, gguf_path: str, n_ctx: int = 2048, n_threads: int | None = None,
                 warmup_requests: Sequence[BenchRequest] = ()):
        if not available():
            raise SystemExit("--compare llama_cpp needs llama-cpp-python: pip install "
                             "'jaxpd[llama-cpp]' (see the README for building it)")
        import llama_cpp
        from jaxpd.models.source import checkpoint_path, is_gguf

        path = checkpoint_path(gguf_path)
        if not is_gguf(path):
            raise SystemExit(f"--compare llama_cpp serves GGUF files only; --model is {path}")
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        self.model = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=self.n_threads,
                                     n_threads_batch=self.n_threads, verbose=False)
        for r in list(warmup_requests)[:2]:
            self._generate(r)

    def _generate(self, r: BenchRequest) -> list[float]:
        """Token times (perf_counter) of one request, greedy, `output_len` tokens."""
        self.model.reset()
        times: list[float] = []
        for _ in self.model.generate(list(r.prompt_ids), temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) >= r.output_len:
                break
        return times

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        timelines: dict[int, RequestTimeline] = {}
        origin = time.perf_counter()
        while pending:
            r = pending.popleft()
            sleep_until(origin + r.arrival_s)
            tokens = [t - origin for t in self._generate(r)]
            timelines[r.index] = RequestTimeline(r.arrival_s, tokens, tokens[-1])
            if on_done is not None:
                on_done()
        ordered = [timelines[r.index] for r in requests]
        return RunResult(ordered, run_duration(ordered), 0, {"n_threads": self.n_threads})

    def close(self) -> None:
        close = getattr(self.model, "close", None)     # llama-cpp-python >= 0.2.80
        if close is not None:
            close()
        self.model = None
