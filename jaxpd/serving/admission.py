"""Admission control by predicted time to first token (plain Python, no jax).

A request that would wait longer than the TTFT SLO is better rejected at once
(RESOURCE_EXHAUSTED, the client can go elsewhere) than queued to miss its SLO and make
every request behind it later too. The prediction is deliberately simple:

    predicted TTFT = (tokens ahead + own prompt tokens) * s_per_token + overhead

- tokens ahead: prompt tokens of the requests still waiting for or in prefill when
  the new one arrives (the caller counts them; preempted requests count again);
- s_per_token: a running mean (EWMA) over finished requests of
  (queue_s + prefill_s) / (tokens ahead at their arrival + their own tokens), i.e. the
  measured rate at which the prefill queue drains -- batching included, which a
  per-request prefill_s / prompt length would miss;
- overhead: a running mean of what TTFT adds after prefill (transfer, first emit).

With nothing ahead the request is always admitted: it cannot be served sooner by
rejecting it, and admitting keeps the estimate fresh, so a stale pessimistic estimate
(e.g. from a first request that paid for compilation) cannot reject forever.
"""
from __future__ import annotations

import math
import threading

from jaxpd.outputs import RequestMetrics


class AdmissionController:
    """Thread-safe TTFT predictor and SLO gate. `slo_ttft_s` 0 turns the gate off
    (predictions are still made and exported)."""

    def __init__(self, slo_ttft_s: float = 0.0, smoothing: float = 0.2):
        if not (slo_ttft_s >= 0 and math.isfinite(slo_ttft_s)):
            raise ValueError(f"slo_ttft_s must be a finite number >= 0, got {slo_ttft_s!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.slo_ttft_s = slo_ttft_s
        self._smoothing = smoothing
        self._lock = threading.Lock()
        self._s_per_token: float | None = None
        self._overhead_s = 0.0
        self.num_rejected = 0

    @property
    def s_per_token(self) -> float | None:
        """Current estimate of queue seconds per prompt token; None before any sample."""
        with self._lock:
            return self._s_per_token

    def predict_ttft_s(self, num_tokens_ahead: int, num_prompt_tokens: int) -> float | None:
        """Predicted TTFT of a request arriving now; None while nothing is measured."""
        with self._lock:
            if self._s_per_token is None:
                return None
            return (num_tokens_ahead + num_prompt_tokens) * self._s_per_token + self._overhead_s

    def check(self, num_tokens_ahead: int, num_prompt_tokens: int) -> str | None:
        """None to admit; otherwise the reason for rejecting (and the rejection is counted)."""
        if self.slo_ttft_s == 0 or num_tokens_ahead == 0:
            return None
        predicted = self.predict_ttft_s(num_tokens_ahead, num_prompt_tokens)
        if predicted is None or predicted <= self.slo_ttft_s:
            return None
        with self._lock:
            self.num_rejected += 1
        return (f"predicted TTFT {predicted * 1e3:.1f} ms exceeds the SLO of "
                f"{self.slo_ttft_s * 1e3:.1f} ms ({num_tokens_ahead} prompt tokens wait ahead)")

    def observe(self, num_tokens_ahead: int, num_prompt_tokens: int,
                metrics: RequestMetrics) -> None:
        """Learn from a finished request: the tokens ahead of it when it arrived, its
        prompt length, and its measured phases. Requests without a prefill are skipped."""
        if metrics.queue_s is None or metrics.prefill_s is None or metrics.ttft_s is None:
            return
        work = num_tokens_ahead + num_prompt_tokens
        if work <= 0:
            return
        to_prefill_end = metrics.queue_s + metrics.prefill_s
        rate = to_prefill_end / work
        overhead = max(metrics.ttft_s - to_prefill_end, 0.0)
        a = self._smoothing
        with self._lock:
            if self._s_per_token is None:
                self._s_per_token, self._overhead_s = rate, overhead
            else:
                self._s_per_token += a * (rate - self._s_per_token)
                self._overhead_s += a * (overhead - self._overhead_s)
