"""Serving metrics: per-request timelines, their aggregates, SLO goodput, histograms.

Definitions (the same for real runs and for the simulator):
- TTFT: first output token time - arrival time.
- TPOT: mean time per output token *after the first*, (last - first) / (n - 1).
  The first token is excluded because it is produced by prefill and already
  counted in TTFT; mixing it in would blur the two phases disaggregation separates.
- ITL: each gap between consecutive output tokens (the jitter TPOT averages away).
- E2E: finish time - arrival time.
- Goodput: the highest request rate at which at least `target` (90%) of requests
  meet both the TTFT and the TPOT SLO.

Percentiles interpolate linearly between samples (numpy's default), so the p99 of
a small run is not just its maximum.

Plain Python and numpy: no jax import, so benchmarks and the simulator can use
this module without touching a device.
"""
from __future__ import annotations

import dataclasses
import math
import re
import threading
from typing import Callable, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def ttft(arrival: float, token_times: Sequence[float]) -> float | None:
    """Time to first token: the first token's time minus arrival; None before one."""
    return token_times[0] - arrival if token_times else None


def tpot(token_times: Sequence[float]) -> float | None:
    """Time per output token: the mean gap between output tokens, the first token
    excluded (it is TTFT's); None with fewer than 2 tokens."""
    n = len(token_times)
    return (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None


@dataclasses.dataclass(frozen=True)
class RequestTimeline:
    """Wall-clock times (seconds, one shared clock) of one request's life.

    `token_times_s` holds the emission time of every output token, the first one
    included; it is stored as a tuple. It may be empty for a request that was aborted
    before its first token: such a request has no TTFT and never meets an SLO.
    The optional phase times (`queue_s`, `prefill_s`, `transfer_s`) and
    `transfer_bytes` are durations/sizes, filled in when the runner knows them.
    """
    arrival_s: float
    token_times_s: Sequence[float]
    finish_s: float
    queue_s: float | None = None
    prefill_s: float | None = None
    transfer_s: float | None = None
    transfer_bytes: int | None = None

    def __post_init__(self):
        # A tuple keeps the frozen timeline really immutable (and hashable).
        object.__setattr__(self, "token_times_s", tuple(float(t) for t in self.token_times_s))
        times = self.token_times_s
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"RequestTimeline.arrival_s must be finite, got {self.arrival_s}")
        if not all(math.isfinite(t) for t in times):
            raise ValueError(f"RequestTimeline.token_times_s must be finite, got {times}")
        if times and times[0] < self.arrival_s:
            raise ValueError(f"RequestTimeline: first token at {times[0]} precedes "
                             f"arrival at {self.arrival_s}")
        if any(later < earlier for earlier, later in zip(times, times[1:])):
            raise ValueError(f"RequestTimeline.token_times_s must be non-decreasing, got {times}")
        last = times[-1] if times else self.arrival_s
        if not self.finish_s >= last:
            raise ValueError(f"RequestTimeline.finish_s={self.finish_s} precedes the last "
                             f"event at {last}")
        for field in ("queue_s", "prefill_s", "transfer_s", "transfer_bytes"):
            value = getattr(self, field)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"RequestTimeline.{field} must be >= 0 and finite, got {value}")

    @property
    def num_tokens(self) -> int:
        """Number of output tokens emitted."""
        return len(self.token_times_s)

    @property
    def ttft(self) -> float | None:
        """Time to first token; None when no token was emitted."""
        return ttft(self.arrival_s, self.token_times_s)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token excluding the first; None with fewer than 2 tokens."""
        return tpot(self.token_times_s)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens (n - 1 of them)."""
        times = self.token_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def e2e(self) -> float:
        """End-to-end latency: finish - arrival."""
        return self.finish_s - self.arrival_s


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of `values` as floats; all None when `values` is empty."""
    array = np.asarray(list(values), dtype=np.float64)
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if array.size == 0:
        return dict.fromkeys(keys, None)
    stats = [float(array.mean())] + [float(v) for v in np.percentile(array, PERCENTILES)]
    return dict(zip(keys, stats))


def meets_slo(timeline: RequestTimeline, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Whether one request met both SLOs (bounds inclusive).

    A request with a single output token has no TPOT; it meets the TPOT SLO
    trivially, because there was no decode phase that could have been slow.
    A request with no token at all has no TTFT and fails.
    """
    ttft, tpot = timeline.ttft, timeline.tpot
    if ttft is None or ttft > slo_ttft_s:
        return False
    return tpot is None or tpot <= slo_tpot_s


def slo_attainment(timelines: Sequence[RequestTimeline], slo_ttft_s: float,
                   slo_tpot_s: float) -> float:
    """Fraction of `timelines` that meet both SLOs (see `meets_slo`)."""
    if not timelines:
        raise ValueError("slo_attainment needs at least one timeline")
    num_met = sum(meets_slo(t, slo_ttft_s, slo_tpot_s) for t in timelines)
    return num_met / len(timelines)


def find_goodput(attainment_at_rate: Callable[[float], float], lo: float, hi: float,
                 target: float = 0.9, rel_tol: float = 0.05,
                 max_iters: int = 20) -> float | None:
    """The highest request rate in [lo, hi] whose SLO attainment is >= `target`.

    Bisection, assuming attainment does not rise with rate. Returns `hi` when `hi`
    passes, None when even `lo` fails. Otherwise it stops once the passing and the
    failing rate are within `rel_tol` of the passing one (or after `max_iters`
    probes) and returns the passing rate: a rate that was measured to pass, never
    an interpolated guess. Each probe is usually a whole benchmark run, so `hi` is
    probed first (one run when everything passes).
    """
    if not 0 < lo <= hi or not math.isfinite(hi):
        raise ValueError(f"find_goodput needs 0 < lo <= hi < inf, got lo={lo}, hi={hi}")
    if not 0 < target <= 1:
        raise ValueError(f"find_goodput target must be in (0, 1], got {target}")
    if not rel_tol > 0:
        raise ValueError(f"find_goodput rel_tol must be > 0, got {rel_tol}")
    if max_iters < 0:
        raise ValueError(f"find_goodput max_iters must be >= 0, got {max_iters}")
    if attainment_at_rate(hi) >= target:
        return hi
    if attainment_at_rate(lo) < target:
        return None
    passing, failing = lo, hi
    for _ in range(max_iters):
        if failing - passing <= rel_tol * passing:
            break
        mid = (passing + failing) / 2
        if attainment_at_rate(mid) >= target:
            passing = mid
        else:
            failing = mid
    return passing


# Seconds; spans a fast decode step (ms) to a long queued prefill (tens of s).
DEFAULT_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                             10.0, 30.0)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _format_float(value: float) -> str:
    """Prometheus spelling of a float (as the Go and Python clients write it)."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


class LatencyHistogram:
    """A Prometheus-style histogram with fixed bucket upper bounds.

    A value x falls in every bucket whose bound `le` satisfies x <= le; the +Inf
    bucket is implicit. Safe to `observe` from several threads (worker threads
    record while the metrics endpoint renders).
    """

    def __init__(self, bounds: Sequence[float] = DEFAULT_LATENCY_BUCKETS_S):
        bounds = tuple(float(b) for b in bounds)
        if not bounds:
            raise ValueError("LatencyHistogram needs at least one bucket bound")
        if not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"LatencyHistogram bounds must be finite (+Inf is implicit), "
                             f"got {bounds}")
        if any(later <= earlier for earlier, later in zip(bounds, bounds[1:])):
            raise ValueError(f"LatencyHistogram bounds must be strictly increasing, got {bounds}")
        self._bounds = bounds
        self._lock = threading.Lock()
        # Per-bucket (not cumulative) counts; the last slot is the +Inf overflow.
        self._bucket_counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._count = 0

    @property
    def bounds(self) -> tuple[float, ...]:
        """The finite bucket upper bounds."""
        return self._bounds

    @property
    def count(self) -> int:
        """Number of observations."""
        with self._lock:
            return self._count

    @property
    def sum(self) -> float:
        """Sum of all observations."""
        with self._lock:
            return self._sum

    def observe(self, value: float) -> None:
        """Record one observation."""
        value = float(value)
        if math.isnan(value):
            raise ValueError("LatencyHistogram cannot observe NaN")
        index = next((i for i, bound in enumerate(self._bounds) if value <= bound),
                     len(self._bounds))
        with self._lock:
            self._bucket_counts[index] += 1
            self._sum += value
            self._count += 1

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """(cumulative count of each bucket, `(le, count)` ending with +Inf; sum), taken
        together; the +Inf count is the number of observations."""
        with self._lock:
            bucket_counts, total = list(self._bucket_counts), self._sum
        cumulative, buckets = 0, []
        for bound, bucket_count in zip(self._bounds + (math.inf,), bucket_counts):
            cumulative += bucket_count
            buckets.append((bound, cumulative))
        return buckets, total

    def render(self, name: str, help: str) -> str:
        """The histogram in Prometheus text exposition format (ends with a newline)."""
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"invalid Prometheus metric name {name!r}")
        buckets, total = self.snapshot()
        escaped_help = help.replace("\\", "\\\\").replace("\n", "\\n")
        lines = [f"# HELP {name} {escaped_help}", f"# TYPE {name} histogram"]
        for bound, cumulative in buckets:
            lines.append(f'{name}_bucket{{le="{_format_float(bound)}"}} {cumulative}')
        lines.append(f"{name}_sum {_format_float(total)}")
        lines.append(f"{name}_count {buckets[-1][1]}")
        return "\n".join(lines) + "\n"


def run_report(name: str, timelines: Sequence[RequestTimeline], duration_s: float,
               slo_ttft_s: float, slo_tpot_s: float,
               goodput_req_s: float | None = None) -> dict:
    """Aggregate one run's timelines into a plain, JSON-ready dict.

    `duration_s` is the wall time of the run (first arrival to last finish, as the
    caller measured it); throughputs are per second of it. ITL percentiles pool
    every gap of every request; `handoff_gap_s` is each request's first -> second token
    gap alone (in a disaggregated run it holds the KV handoff) and `later_itl_s` every
    gap after it. `slo_attainment` is None for a run with no requests.
    """
    if not duration_s > 0:
        raise ValueError(f"run_report duration_s must be > 0, got {duration_s}")
    ttfts = [t.ttft for t in timelines if t.ttft is not None]
    tpots = [t.tpot for t in timelines if t.tpot is not None]
    itls = [gap for t in timelines for gap in t.itls]
    num_output_tokens = sum(t.num_tokens for t in timelines)
    return {
        "name": name,
        "ttft_s": summarize(ttfts),
        "tpot_s": summarize(tpots),
        "itl_s": summarize(itls),
        "handoff_gap_s": summarize(t.itls[0] for t in timelines if t.itls),
        "later_itl_s": summarize(gap for t in timelines for gap in t.itls[1:]),
        "e2e_s": summarize(t.e2e for t in timelines),
        "output_tok_s": num_output_tokens / duration_s,
        "req_s": len(timelines) / duration_s,
        "slo_attainment": (slo_attainment(timelines, slo_ttft_s, slo_tpot_s)
                           if timelines else None),
        "goodput_req_s": goodput_req_s,
        "num_requests": len(timelines),
    }


def _cell(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(reports: Sequence[dict]) -> str:
    """`run_report` dicts side by side: one column per run, one row per metric.

    Latencies are shown in milliseconds, attainment in percent.
    """
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(r["num_requests"]) for r in reports]),
        ("req/s", [_cell(r["req_s"]) for r in reports]),
        ("output tok/s", [_cell(r["output_tok_s"], digits=1) for r in reports]),
        ("SLO attainment %", [_cell(r["slo_attainment"], scale=100, digits=1)
                              for r in reports]),
        ("goodput req/s", [_cell(r["goodput_req_s"]) for r in reports]),
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"),
                       ("e2e_s", "E2E"), ("handoff_gap_s", "1st->2nd token gap"),
                       ("later_itl_s", "later ITL")):
        stats = ("p50", "p99") if key in ("handoff_gap_s", "later_itl_s") else (
            "mean", "p50", "p90", "p99")
        for stat in stats:
            rows.append((f"{label} {stat} (ms)",
                         [_cell(r.get(key, {}).get(stat), scale=1e3, digits=1)
                          for r in reports]))
    header = ("metric", [str(r["name"]) for r in reports])
    label_width = max(len(label) for label, _ in [header] + rows)
    column_widths = [max(len(cells[i]) for _, cells in [header] + rows)
                     for i in range(len(reports))]

    def line(label: str, cells: list[str]) -> str:
        padded = [cell.rjust(width) for cell, width in zip(cells, column_widths)]
        return "  ".join([label.ljust(label_width)] + padded).rstrip()

    separator = "-" * len(line(*header))
    return "\n".join([line(*header), separator] + [line(*row) for row in rows])
