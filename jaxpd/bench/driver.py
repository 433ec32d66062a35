"""The benchmark's workload driver: the same timed requests through any backend.

A `BenchRequest` is a `WorkloadRequest` with concrete prompt token ids, drawn once
from the seed so every backend (every mesh, and transformers) sees identical
prompts. A backend turns a list of them into one `RequestTimeline` per request,
honouring the arrival times on a clock that starts when `run` is called.

`EngineBackend` drives the in-process jaxpd engine (`LLM`): a submitter thread
(`jaxpd-bench-submit`) sleeps until each arrival and submits; the calling thread
waits for the requests in submission order and ticks the progress bar. Timelines
come from `Request.timings` (perf_counter stamps), with arrival = submit time.
A request the engine rejected or aborted still yields a timeline (no tokens, or
fewer than asked), so every request is counted and fails its SLO.
"""
from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from jaxpd.metrics import RequestTimeline
from jaxpd.stats import COUNTERS, EngineStats
from jaxpd.bench.workload import WorkloadRequest

# Ids below this are often special (pad/bos/eos) in small vocabularies; real text
# rarely hits them, so random prompts avoid them too.
FIRST_ORDINARY_ID = 3     # below: the special tokens a random prompt must avoid


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark run: arrival (s from the run's start), prompt, length."""
    index: int
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_len: int


def make_bench_requests(workload: Sequence[WorkloadRequest], vocab_size: int,
                        seed: int, draw: int = 0) -> list[BenchRequest]:
    """Attach random prompt token ids (fixed by `seed` and `draw`) to each workload
    request.

    The ids depend on the seed, the draw and each request's index and length only,
    never on the rate. A rate sweep gives each rate a draw of its own: the same
    lengths and arrivals re-timed, with prompts no earlier run has sent, so a prefix
    cache on by default in one backend cannot serve a later rate from an earlier one.
    """
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size={vocab_size} is too small for random prompts")
    out = []
    for w in workload:
        rng = np.random.default_rng([seed, w.index] if draw == 0 else [seed, draw, w.index])
        ids = rng.integers(FIRST_ORDINARY_ID, vocab_size, size=w.prompt_len)
        out.append(BenchRequest(w.index, w.arrival_s, tuple(int(i) for i in ids), w.output_len))
    return out


@dataclasses.dataclass
class RunResult:
    """What one backend run produced: timelines on a clock starting at 0, and extras."""
    timelines: list[RequestTimeline]
    duration_s: float          # first arrival to last finish
    num_aborted: int = 0
    stats: dict = dataclasses.field(default_factory=dict)


class Backend(Protocol):
    """Something that serves a timed list of requests (an engine mesh, transformers)."""
    name: str

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult: ...

    def close(self) -> None: ...


class Progress:
    """A progress bar: tqdm when installed, else a one-line counter on stderr."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self._bar = None
        self._total, self._desc, self._count = total, desc, 0
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

    def update(self) -> None:
        self._count += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self._enabled:
            end = "\n" if self._count == self._total else ""
            print(f"\r{self._desc}: {self._count}/{self._total}", end=end, file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def sleep_until(deadline: float) -> None:
    """Sleep until perf_counter() reaches `deadline` (no-op when it has passed)."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def timeline_of(timings, origin: float) -> RequestTimeline:
    """A `RequestTimeline` from `Request.timings`, times shifted so `origin` is 0."""
    tokens = [t - origin for t in timings.token_times]
    arrival = timings.arrival - origin
    last = tokens[-1] if tokens else arrival
    finish = max(last, (timings.finish if timings.finish is not None else timings.arrival) - origin)
    queue_s = prefill_s = None
    if timings.prefill_start is not None:
        queue_s = max(0.0, timings.prefill_start - timings.arrival)
        if timings.prefill_end is not None:
            prefill_s = max(0.0, timings.prefill_end - timings.prefill_start)
    return RequestTimeline(arrival, tokens, finish, queue_s=queue_s, prefill_s=prefill_s,
                           transfer_s=timings.transfer_s, transfer_bytes=timings.transfer_bytes)


def run_duration(timelines: Sequence[RequestTimeline]) -> float:
    """First arrival to last finish (never 0: rates are divided by it)."""
    if not timelines:
        return 1e-9
    start = min(t.arrival_s for t in timelines)
    return max(max(t.finish_s for t in timelines) - start, 1e-9)


class FrontendBackend:
    """Drives any `Frontend` (an in-process `LLM`, or a `Router` in front of worker
    processes) with a timed request list. Subclasses build `self.front` and say when
    it is idle and what its counters are."""
    name: str
    front = None

    def warm(self, warmup_requests: Sequence[BenchRequest],
             warm_prompt_lens: Sequence[int] = ()) -> None:
        """Compiling every bucket (warmup=True) still leaves first-call costs (thread
        start, allocator paths, and the small programs keyed on a prompt's exact page
        count and its batch's padded shape: cutting its pages out of the batch, padding
        them for insert). Requests of the run's shapes pay them here, outside the
        measurement. Their tokens are not the run's (each prompt reversed; distinct rows
        of one batch): a prefix cache must not hold a timed prompt before it arrives."""
        if warmup_requests:
            self.front.generate(
                prompt_token_ids=[list(reversed(r.prompt_ids)) for r in warmup_requests],
                sampling_params=[greedy(r.output_len) for r in warmup_requests])
        rows = 0
        for n, size in self.prefill_shapes(warm_prompt_lens):
            # Submitted together, they wait (bucket_timeout_ms) and run as one batch.
            prompts = [[FIRST_ORDINARY_ID + (rows + j) % 97] + [FIRST_ORDINARY_ID] * (n - 1)
                       for j in range(size)]
            rows += size
            self.front.generate(prompt_token_ids=prompts, sampling_params=greedy(2))
        self._wait_idle()
        self.settle()

    def settle(self) -> None:
        """Wait for what the warm-up asked to compile in the background (none here)."""

    def prefill_shapes(self, prompt_lens: Sequence[int]) -> list[tuple[int, int]]:
        """(prompt length, batch size) pairs that cover every padded prefill batch the
        scheduler can form for these lengths; none where it is not known here."""
        return []

    def is_idle(self) -> bool:
        return True

    def finished(self, request) -> None:
        """`request` is done (a backend that watches its own latencies records it)."""

    def counters(self) -> dict:
        return {}

    def counters_delta(self, before: dict, after: dict) -> dict:
        return after

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        front = self.front
        # Validate everything before the clock starts: a bad request is a usage error.
        made = [(r, front.make_request(prompt_token_ids=list(r.prompt_ids),
                                       sampling_params=greedy(r.output_len)))
                for r in requests]
        submitted: queue.Queue = queue.Queue()
        before = self.counters()
        origin = time.perf_counter()

        def submit_all() -> None:
            for bench_request, request in made:
                sleep_until(origin + bench_request.arrival_s)
                request.timings.arrival = time.perf_counter()   # arrival = submit time
                try:
                    front.submit(request)
                except Exception as e:   # rejected (queue full) or engine dead: counted
                    request.abort(f"rejected: {e}")
                submitted.put(request)

        submitter = threading.Thread(target=submit_all, name="jaxpd-bench-submit", daemon=True)
        submitter.start()
        requests_done = []
        for _ in made:
            request = submitted.get()
            for _ in front.events(request):
                pass
            self.finished(request)
            requests_done.append(request)
            if on_done is not None:
                on_done()
        submitter.join()
        self._wait_idle()
        timelines = [timeline_of(r.timings, origin) for r in requests_done]
        num_aborted = sum(r.finish_reason == "abort" for r in requests_done)
        return RunResult(timelines, run_duration(timelines), num_aborted,
                         self.counters_delta(before, self.counters()))

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_idle() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.front.shutdown()


class EngineBackend(FrontendBackend):
    """One `LLM` on one mesh, built and warmed up before any clock starts."""

    def __init__(self, model_dir: str, mesh: str, engine_options: dict,
                 warmup_requests: Sequence[BenchRequest] = (),
                 warm_prompt_lens: Sequence[int] = (), compile_ahead: bool = True,
                 name: str | None = None):
        from jaxpd.llm import LLM
        self.name = name or mesh
        self.front = self.llm = LLM(model_dir, mesh=mesh, warmup=compile_ahead,
                                    **engine_options)
        if compile_ahead:
            self.warm(warmup_requests, warm_prompt_lens)

    def prefill_shapes(self, prompt_lens: Sequence[int]) -> list[tuple[int, int]]:
        engine = self.llm.engine
        if engine.prefill_loop is None:     # every prompt prefilled into its slot
            return []
        return padded_prefill_shapes(engine.prefill_scheduler, prompt_lens)

    def is_idle(self) -> bool:
        return self.llm.engine.is_idle()

    def settle(self) -> None:
        from jaxpd.engine.compile.background import settle
        settle(self.llm.engine)

    def counters(self) -> dict:
        return self.llm.stats()

    def counters_delta(self, before: dict, after: dict) -> dict:
        return stats_delta(before, after)


def padded_prefill_shapes(scheduler, prompt_lens: Sequence[int]) -> list[tuple[int, int]]:
    """Each prompt length in every padded batch size `scheduler` can form for it."""
    out = []
    for n in sorted(set(prompt_lens)):
        bucket = scheduler.bucket_for(n)
        out += [(n, size) for size in
                sorted({scheduler.padded_batch(b, bucket) for b in scheduler.batch_sizes})]
    return out


# Engine counters that accumulate over the engine's life; a run reports its own share.
def stats_delta(before: EngineStats, after: EngineStats) -> dict:
    """`after` with every counter replaced by its growth since `before`."""
    return {k: (v - before[k] if k in COUNTERS else v) for k, v in after.items()}


def greedy(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored)."""
    from jaxpd.sampling_params import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def ensure_cpu_devices(num_devices: int) -> None:
    """Ask for at least `num_devices` virtual CPU devices, as the launcher does.

    Only effective before jax initialises its backend (the first `jax.devices()`),
    which is why the CLIs parse their flags and call this before touching jax. It
    only concerns the host platform; accelerators ignore the flag.
    """
    import os

    from jaxpd.sharding.cpu_devices import xla_flags_with_count
    os.environ["XLA_FLAGS"] = xla_flags_with_count(os.environ.get("XLA_FLAGS", ""),
                                                   num_devices, at_least=True)
