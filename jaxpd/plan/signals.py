"""`Signals`: one observation of a serving system, what the split controller and its
latency model both read (pure Python)."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Signals:
    """One observation of a serving system. Latencies in seconds (None: nothing
    measured in the window); occupancies in [0, 1]."""
    t: float
    ttft_p90_s: float | None = None
    predicted_ttft_s: float | None = None      # the admission model's, for the queue now
    tpot_p90_s: float | None = None
    slot_occupancy: float = 0.0
    page_occupancy: float = 0.0
    prefill_queue: int = 0
    # For the latency model: the window's means (queue wait, prefill time and TTFT of the
    # requests that had all three) and how many requests measured them and TPOT.
    ttft_mean_s: float | None = None
    queue_mean_s: float | None = None
    prefill_mean_s: float | None = None
    num_prefilled: int = 0
    num_tpot: int = 0

    def __post_init__(self):
        for name in ("ttft_p90_s", "predicted_ttft_s", "tpot_p90_s", "ttft_mean_s",
                     "queue_mean_s", "prefill_mean_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("slot_occupancy", "page_occupancy"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if min(self.num_prefilled, self.num_tpot) < 0:
            raise ValueError("num_prefilled and num_tpot must be >= 0")
