"""`python -m jaxpd.plan --live URL`: watch a running deployment's Prometheus /metrics
(a router's or a single process's HTTP port) and print, as `SplitController` decides,
which prefill/decode split it would move to and why. It recommends; it does not act.

Each scrape is compared with the one before: TTFT and TPOT p90 come from the
histograms' bucket counts *in that window* (as Prometheus' `histogram_quantile` over a
`rate()`), occupancies from the slot and page gauges; and for the controller's latency
model (`split_model`) the window's means (sum over count) of TTFT, the queue wait and the
prefill time, and how many requests measured them and TPOT. Each line shows what the
model predicts a move either way would do, and a move it vetoed is printed with why.
"""
from __future__ import annotations

import math
import time
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from jaxpd.plan.controller import Prediction, Signals, Split, SplitController

Buckets = list[tuple[float, float]]           # (upper bound, cumulative count)


def parse_metrics(text: str) -> tuple[dict[str, Buckets], dict[str, float]]:
    """(histogram buckets by family name, plain samples by sample name)."""
    histograms: dict[str, Buckets] = {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "histogram" and sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                histograms.setdefault(family.name, []).append((bound, sample.value))
            elif not sample.labels:
                values[sample.name] = sample.value
    return {k: sorted(v) for k, v in histograms.items()}, values


def window_quantile(before: Buckets | None, after: Buckets, q: float) -> float | None:
    """The q-quantile of what was observed between two scrapes of one histogram
    (linear within a bucket; the last finite bound for the +Inf bucket); None when
    nothing was observed."""
    counts = dict(before or [])
    window = [(bound, count - counts.get(bound, 0.0)) for bound, count in after]
    total = window[-1][1] if window else 0.0
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for bound, cumulative in window:
        if cumulative >= rank:
            if math.isinf(bound):
                return low
            inside = cumulative - below
            return low + (bound - low) * ((rank - below) / inside if inside else 1.0)
        low, below = bound, cumulative
    return low


def window_mean(before: dict[str, float], after: dict[str, float],
                name: str) -> tuple[float | None, int]:
    """(mean, count) of what histogram `name` observed between two scrapes' samples;
    (None, 0) when nothing was, or the counts went back (a worker left a router's sums)."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    if count <= 0 or total < 0:
        return None, 0
    return total / count, int(count)


class LiveSignals:
    """`Signals` from successive /metrics texts."""

    def __init__(self):
        self._before: dict[str, Buckets] = {}
        self._values: dict[str, float] = {}

    def observe(self, t: float, text: str) -> Signals:
        histograms, values = parse_metrics(text)
        p90 = {name: window_quantile(self._before.get(name), buckets, 0.9)
               for name, buckets in histograms.items()}
        mean = {name: window_mean(self._values, values, name) for name in histograms}
        self._before, self._values = histograms, values
        queue_s, num_prefilled = mean.get("jaxpd_queue_seconds", (None, 0))
        prefill_s = mean.get("jaxpd_prefill_seconds", (None, 0))[0]

        def share(used: str, total: str) -> float:
            whole = values.get(total, 0.0)
            return min(1.0, max(0.0, values.get(used, 0.0) / whole)) if whole > 0 else 0.0

        return Signals(t, ttft_p90_s=p90.get("jaxpd_ttft_seconds"),
                       tpot_p90_s=p90.get("jaxpd_tpot_seconds"),
                       slot_occupancy=share("jaxpd_slots_active", "jaxpd_slots_total"),
                       page_occupancy=share("jaxpd_pages_used", "jaxpd_pages_total"),
                       prefill_queue=int(values.get("jaxpd_queue_waiting", 0)),
                       ttft_mean_s=mean.get("jaxpd_ttft_seconds", (None, 0))[0],
                       queue_mean_s=queue_s, prefill_mean_s=prefill_s,
                       num_prefilled=num_prefilled,
                       num_tpot=mean.get("jaxpd_tpot_seconds", (None, 0))[1])


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def run_live(url: str, controller: SplitController, interval_s: float, count: int | None,
             say: Callable[[str], None] = print, fetch: Callable[[str], str] = _fetch,
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> list:
    """Scrape `count` times (None: until interrupted), `interval_s` apart; print each
    observation and every recommendation; returns the decisions."""
    live, n, num_vetoes = LiveSignals(), 0, controller.num_vetoes
    while count is None or n < count:
        if n:
            sleep(interval_s)
        s = live.observe(clock(), fetch(url))
        decision = controller.observe(s)
        ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"
        say(f"t={s.t:.0f}s split {controller.split if decision is None else decision.old}: "
            f"TTFT p90 {ms(s.ttft_p90_s)} ms, TPOT p90 {ms(s.tpot_p90_s)} ms, slots "
            f"{s.slot_occupancy:.0%}, pages {s.page_occupancy:.0%}, queue {s.prefill_queue}; "
            f"pressure prefill {controller.prefill_pressure:.2f} decode "
            f"{controller.decode_pressure:.2f}{_predictions(controller)}")
        if decision is not None:
            say(f"recommend {decision.new} (from {decision.old}): {decision.reason}")
        elif controller.num_vetoes > num_vetoes:
            say(str(controller.vetoes[-1]))
        num_vetoes = controller.num_vetoes
        n += 1
    return controller.decisions


def _predictions(controller: SplitController) -> str:
    """'; predicted after prefill=P,decode=D: ...' for each move the split allows and
    the latency model can predict."""
    predictions = [controller.predict(d) for d in ("to_prefill", "to_decode")]
    shown = [str(p) for p in predictions if _allowed(controller, p)
             and (p.prefill, p.decode) != (None, None)]
    return f"; predicted after {' | '.join(shown)}" if shown else ""


def _allowed(controller: SplitController, p: Prediction) -> bool:
    return min(p.new.prefill, p.new.decode) >= controller.min_devices


def parse_split(text: str) -> Split:
    """'prefill=P,decode=D' -> Split; ValueError naming --live_split otherwise."""
    parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    try:
        split = Split(int(parts["prefill"]), int(parts["decode"]))
    except (KeyError, ValueError):
        raise ValueError(f"--live_split must be prefill=P,decode=D, got {text!r}") from None
    if min(split.prefill, split.decode) < 1 or len(parts) != 2:
        raise ValueError(f"--live_split must be prefill=P,decode=D with P, D >= 1, got {text!r}")
    return split
