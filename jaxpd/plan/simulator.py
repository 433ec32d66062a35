"""Discrete-event simulator of disaggregated vs colocated serving, for placement planning.

In the spirit of DistServe's planner: fit a latency model of one prefill batch and of
one decode step from a few measurements, then replay a synthetic workload through
each placement on paper and compare SLO goodput, before spending devices on it.

Modelled:
- Prefill batch time `a + b * sum(len) + c * sum(len^2)` (the last term is attention);
  decode step time `a + b * batch + c * sum(context)` (weights read once per step,
  then per-request and per-KV-token work).
- Disaggregated: prefill instances run FCFS batches of up to `max_prefill_batch`
  prompts; each finished prompt's KV moves for `transfer_s_per_token * prompt_len`
  seconds (transfers run in parallel, no link contention), then joins a decode
  instance, which runs continuous batching over at most `max_decode_batch` requests.
  The first token reaches the client when the transfer lands (the decode side streams
  it, as in jaxpd), so TTFT = queue + prefill + transfer.
- Colocated: each instance runs one loop. Whenever prompts wait and a decode slot is
  free, it runs a prefill batch (prefill priority, as continuous-batching servers do)
  and every running decode waits for it; otherwise it runs a decode step.
- A request with one output token is finished by prefill: no transfer, no decode.
- Routing is least-loaded (fewest requests queued or running on the instance, ties
  to the lowest index), decided when the request reaches that stage. FCFS inside an
  instance. Requests join a decode batch only at step boundaries.

Not modelled: KV memory limits and preemption, network contention, chunked prefill.

Events at the same instant are all applied before any idle instance picks new work,
so simultaneous arrivals can share a batch. Everything is deterministic.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from typing import Callable, Iterable, Sequence

import numpy as np

from jaxpd.metrics import RequestTimeline
from jaxpd.bench.workload import WorkloadRequest


def _check_coefficients(owner: str, **coefficients: float) -> None:
    for name, value in coefficients.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{owner}.{name} must be >= 0 and finite, got {value}")


@dataclasses.dataclass(frozen=True)
class PrefillModel:
    """Seconds for one prefill batch: a + b * total_tokens + c * sum(len^2)."""
    a: float
    b: float
    c: float

    def __post_init__(self):
        _check_coefficients("PrefillModel", a=self.a, b=self.b, c=self.c)

    def batch_time(self, prompt_lens: Sequence[int]) -> float:
        """Time to prefill prompts of these lengths together."""
        return (self.a + self.b * sum(prompt_lens)
                + self.c * sum(length * length for length in prompt_lens))


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Seconds for one decode step: a + b * batch + c * total_context_tokens."""
    a: float
    b: float
    c: float

    def __post_init__(self):
        _check_coefficients("DecodeModel", a=self.a, b=self.b, c=self.c)

    def step_time(self, context_lens: Sequence[int]) -> float:
        """Time of one step over requests whose KV holds these many tokens."""
        return self.a + self.b * len(context_lens) + self.c * sum(context_lens)


def _fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0.

    A plain fit on noisy timings can give a small negative term; rather than only
    zeroing it, drop that feature and refit, so the others absorb its share.
    """
    # Columns span 1 to ~1e7 (sum of squared lengths): scale them for conditioning.
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = features / scale
    active = list(range(features.shape[1]))
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(scaled[:, active], seconds, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        del active[int(np.argmin(solution))]
    return coefficients / scale


def _as_samples(name: str, samples: Iterable[tuple[Sequence[int], float]]):
    samples = [(list(lengths), float(seconds)) for lengths, seconds in samples]
    if not samples:
        raise ValueError(f"{name} needs at least one (lengths, seconds) sample")
    for lengths, seconds in samples:
        if not lengths:
            raise ValueError(f"{name}: a sample has an empty batch")
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"{name}: seconds must be >= 0 and finite, got {seconds}")
    return samples


def fit_prefill(samples: Iterable[tuple[Sequence[int], float]]) -> PrefillModel:
    """Fit a PrefillModel to measured (prompt lengths of the batch, seconds) samples."""
    samples = _as_samples("fit_prefill", samples)
    features = np.array([[1.0, sum(lengths), sum(n * n for n in lengths)]
                         for lengths, _ in samples], dtype=np.float64)
    seconds = np.array([s for _, s in samples])
    return PrefillModel(*(float(x) for x in _fit_nonnegative(features, seconds)))


def fit_decode(samples: Iterable[tuple[Sequence[int], float]]) -> DecodeModel:
    """Fit a DecodeModel to measured (context lengths of the batch, seconds) step samples.

    The batch size of a sample is the number of context lengths given.
    """
    samples = _as_samples("fit_decode", samples)
    features = np.array([[1.0, len(lengths), sum(lengths)] for lengths, _ in samples],
                        dtype=np.float64)
    seconds = np.array([s for _, s in samples])
    return DecodeModel(*(float(x) for x in _fit_nonnegative(features, seconds)))


@dataclasses.dataclass
class _Progress:
    """The mutable record of one request as it moves through the simulation."""
    request: WorkloadRequest
    prefill_start_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float | None = None
    token_times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def context_len(self) -> int:
        # The step attends over the prompt and every token emitted so far.
        return self.request.prompt_len + len(self.token_times_s)

    @property
    def is_done(self) -> bool:
        return len(self.token_times_s) >= self.request.output_len

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(
            arrival_s=self.request.arrival_s, token_times_s=self.token_times_s,
            finish_s=self.token_times_s[-1],
            queue_s=self.prefill_start_s - self.request.arrival_s,
            prefill_s=self.prefill_s, transfer_s=self.transfer_s)


@dataclasses.dataclass
class _Instance:
    """One model replica: prompts waiting for prefill or decode, and its decode batch."""
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
    prefilling: list = dataclasses.field(default_factory=list)
    running: list = dataclasses.field(default_factory=list)
    is_busy: bool = False

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)


def _least_loaded(instances: list[_Instance]) -> _Instance:
    return min(instances, key=lambda inst: inst.load)  # min keeps the first of ties


class _EventQueue:
    """Time-ordered callbacks; same-time events run in the order they were pushed."""

    def __init__(self):
        self._heap = []
        self._seq = itertools.count()

    def push(self, time_s: float, callback: Callable[..., None], *args) -> None:
        heapq.heappush(self._heap, (time_s, next(self._seq), callback, args))

    def run(self, dispatch: Callable[[float], None]) -> None:
        """Apply all events of the earliest instant, then `dispatch(now)`; repeat."""
        while self._heap:
            now = self._heap[0][0]
            while self._heap and self._heap[0][0] == now:
                _, _, callback, args = heapq.heappop(self._heap)
                callback(now, *args)
            dispatch(now)


def _check_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _start_prefill(now: float, inst: _Instance, max_batch: int, model: PrefillModel,
                   events: _EventQueue, on_done: Callable[..., None]) -> None:
    batch = [inst.waiting.popleft() for _ in range(min(max_batch, len(inst.waiting)))]
    duration = model.batch_time([p.request.prompt_len for p in batch])
    for progress in batch:
        progress.prefill_start_s = now
        progress.prefill_s = duration
    inst.prefilling = batch
    inst.is_busy = True
    events.push(now + duration, on_done, inst)


def _start_decode_step(now: float, inst: _Instance, model: DecodeModel,
                       events: _EventQueue) -> None:
    duration = model.step_time([p.context_len for p in inst.running])
    inst.is_busy = True
    events.push(now + duration, _finish_decode_step, inst)


def _finish_decode_step(now: float, inst: _Instance) -> None:
    for progress in inst.running:
        progress.token_times_s.append(now)
    inst.running = [p for p in inst.running if not p.is_done]
    inst.is_busy = False


def simulate_disaggregated(workload: Sequence[WorkloadRequest], prefill_model: PrefillModel,
                           decode_model: DecodeModel, num_prefill_instances: int,
                           num_decode_instances: int, max_prefill_batch: int,
                           max_decode_batch: int,
                           transfer_s_per_token: float) -> list[RequestTimeline]:
    """Replay `workload` on separate prefill and decode instances.

    Returns one RequestTimeline per request, in the order of `workload`.
    """
    _check_positive_ints(num_prefill_instances=num_prefill_instances,
                         num_decode_instances=num_decode_instances,
                         max_prefill_batch=max_prefill_batch,
                         max_decode_batch=max_decode_batch)
    if not (transfer_s_per_token >= 0 and math.isfinite(transfer_s_per_token)):
        raise ValueError(f"transfer_s_per_token must be >= 0 and finite, "
                         f"got {transfer_s_per_token}")
    prefill_instances = [_Instance() for _ in range(num_prefill_instances)]
    decode_instances = [_Instance() for _ in range(num_decode_instances)]
    events = _EventQueue()
    progresses = [_Progress(r) for r in workload]

    def on_arrival(now: float, progress: _Progress) -> None:
        _least_loaded(prefill_instances).waiting.append(progress)

    def on_prefill_done(now: float, inst: _Instance) -> None:
        for progress in inst.prefilling:
            if progress.request.output_len == 1:
                progress.token_times_s.append(now)
                continue
            progress.transfer_s = transfer_s_per_token * progress.request.prompt_len
            events.push(now + progress.transfer_s, on_transfer_done, progress)
        inst.prefilling = []
        inst.is_busy = False

    def on_transfer_done(now: float, progress: _Progress) -> None:
        progress.token_times_s.append(now)  # the first token, streamed by the decode side
        _least_loaded(decode_instances).waiting.append(progress)

    def dispatch(now: float) -> None:
        for inst in prefill_instances:
            if not inst.is_busy and inst.waiting:
                _start_prefill(now, inst, max_prefill_batch, prefill_model, events,
                               on_prefill_done)
        for inst in decode_instances:
            if inst.is_busy:
                continue
            while inst.waiting and len(inst.running) < max_decode_batch:
                inst.running.append(inst.waiting.popleft())
            if inst.running:
                _start_decode_step(now, inst, decode_model, events)

    for progress in progresses:
        events.push(progress.request.arrival_s, on_arrival, progress)
    events.run(dispatch)
    return [p.timeline() for p in progresses]


def simulate_colocated(workload: Sequence[WorkloadRequest], prefill_model: PrefillModel,
                       decode_model: DecodeModel, num_instances: int,
                       max_prefill_batch: int, max_decode_batch: int) -> list[RequestTimeline]:
    """Replay `workload` on instances that each interleave prefill and decode.

    Prefill has priority: a prefill batch (limited by `max_prefill_batch` and by the
    free decode slots) runs whenever prompts wait, stalling the running decodes.
    Returns one RequestTimeline per request, in the order of `workload`.
    """
    _check_positive_ints(num_instances=num_instances, max_prefill_batch=max_prefill_batch,
                         max_decode_batch=max_decode_batch)
    instances = [_Instance() for _ in range(num_instances)]
    events = _EventQueue()
    progresses = [_Progress(r) for r in workload]

    def on_arrival(now: float, progress: _Progress) -> None:
        _least_loaded(instances).waiting.append(progress)

    def on_prefill_done(now: float, inst: _Instance) -> None:
        for progress in inst.prefilling:
            progress.token_times_s.append(now)
            if not progress.is_done:
                inst.running.append(progress)
        inst.prefilling = []
        inst.is_busy = False

    def dispatch(now: float) -> None:
        for inst in instances:
            if inst.is_busy:
                continue
            num_free_slots = max_decode_batch - len(inst.running)
            if inst.waiting and num_free_slots > 0:
                _start_prefill(now, inst, min(max_prefill_batch, num_free_slots),
                               prefill_model, events, on_prefill_done)
            elif inst.running:
                _start_decode_step(now, inst, decode_model, events)

    for progress in progresses:
        events.push(progress.request.arrival_s, on_arrival, progress)
    events.run(dispatch)
    return [p.timeline() for p in progresses]
