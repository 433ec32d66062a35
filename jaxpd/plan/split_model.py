"""The elastic split's live latency model: by what factor each role's pressure
would change if `step` devices moved, from what the serving metrics measured at the
split now. The planner fits its models offline, from profiles; this one is refreshed
from every observation, so it knows the load and the split the deployment has now.
`SplitController` asks it before a move (and refuses one the model says would break the
giving role's SLO, or would not help the receiving role). Plain Python.

What it assumes:
- The same requests keep arriving: a move changes a role's capacity, not its load.
- A role's time per unit of work scales with its devices as
  (devices now / devices after) ** efficiency. `efficiency` 1 is the planner's
  `--assume ideal` (tp divides every cost, dp divides per-request work); 0 would be
  devices that change nothing. It starts as given and is then learnt from each move
  (`moved`): once `min_samples` requests have measured a role at its new size, its time
  per unit of work (prefill: the mean batch time; decode: TPOT p90) after / before the
  move gives log(after / before) / log(devices before / after), clipped to [0, 1];
  `efficiency` is the mean of the given value and every one learnt (`learnt`).
- Decode: TPOT p90 scales by that factor; slot and page occupancy by devices now /
  devices after exactly (slots and pages are per dp shard, and a decode device is a
  shard). The decode pressure after is the controller's formula on those.
- Prefill: a request's TTFT is its queue wait W, its prefill time S (its batch's) and the
  rest R = TTFT - W - S (transfer, first emit, a wait for a decode slot), as means over
  the window. S scales by the factor; R does not depend on prefill's devices. The queue
  is read as M/D/1: the utilisation that explains the measured W/S is
  rho = 2W / (S + 2W); after the move rho' = rho x factor and
  W' = rho' S' / (2 (1 - rho')), unbounded once rho' >= 1 (prefill could not keep up).
  The TTFT p90 (and the prefill pressure) scale as the mean, (W' + S' + R) / (W + S + R).
  A batching prefill drains its queue faster than M/D/1 under load, so rho reads below
  the busy fraction: the prediction errs towards allowing a move prefill would feel.
- Each input is an exponential moving average over `smoothing_s` of trace time, kept
  per input from the windows that measured it. A role is predicted only once
  `min_samples` requests have measured it (TPOT for decode; queue and prefill times for
  prefill): before that, `factor` is None and the controller acts as without a model.
"""
from __future__ import annotations

import math

from jaxpd.plan.signals import Signals


class _Average:
    """Exponential moving average over `smoothing_s` of trace time; None before a value."""

    def __init__(self, smoothing_s: float):
        self.smoothing_s, self.value, self._t = smoothing_s, None, 0.0

    def add(self, t: float, x: float | None) -> None:
        if x is None:
            return
        if self.value is None:
            self.value = x
        else:
            keep = math.exp(-(t - self._t) / self.smoothing_s)
            self.value = keep * self.value + (1 - keep) * x
        self._t = t


class SplitModel:
    """Feed it every `Signals` (`observe`); `factor(role, devices, devices_after)` is by
    how much that role's pressure would multiply, or None without enough data."""

    def __init__(self, slo_tpot_s: float, occupancy_high: float = 0.9,
                 smoothing_s: float = 10.0, efficiency: float = 1.0, min_samples: int = 20):
        if not (slo_tpot_s > 0 and occupancy_high > 0 and smoothing_s > 0):
            raise ValueError("slo_tpot_s, occupancy_high and smoothing_s must be > 0")
        if not 0 <= efficiency <= 1:
            raise ValueError(f"efficiency must be in [0, 1], got {efficiency}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.slo_tpot_s, self.occupancy_high = slo_tpot_s, occupancy_high
        self.efficiency, self.min_samples = efficiency, min_samples
        average = lambda: _Average(smoothing_s)            # noqa: E731
        self.tpot_p90_s, self.slots, self.pages = average(), average(), average()
        self.queue_s, self.prefill_s, self.ttft_s = average(), average(), average()
        self.num_prefilled = self.num_tpot = 0
        self._given, self.learnt = efficiency, []
        self._smoothing_s = smoothing_s
        # Since the last move, per role still learning: (devices before, after, time per
        # unit before, its average since, requests measured since).
        self._since_move: dict[str, list] = {}

    def moved(self, before: tuple[int, int], after: tuple[int, int]) -> None:
        """Devices moved from (prefill, decode) `before` to `after`: learn `efficiency`
        from what each role measures next (a move still being learnt from is dropped)."""
        self._since_move = {}
        for role, was, now, unit in (("prefill", before[0], after[0], self.prefill_s.value),
                                     ("decode", before[1], after[1], self.tpot_p90_s.value)):
            if was != now and unit:
                self._since_move[role] = [was, now, unit, _Average(self._smoothing_s), 0]

    def _learn(self, role: str, t: float, unit: float | None, count: int) -> None:
        pending = self._since_move.get(role)
        if pending is None or unit is None:
            return
        was, now, before, average, seen = pending
        average.add(t, unit)
        pending[4] = seen = seen + count
        if seen < self.min_samples:
            return
        del self._since_move[role]
        if average.value > 0:
            learnt = math.log(average.value / before) / math.log(was / now)
            self.learnt.append(min(1.0, max(0.0, learnt)))
            self.efficiency = (self._given + sum(self.learnt)) / (1 + len(self.learnt))

    def observe(self, s: Signals) -> None:
        """Learn from one observation (its window's measurements)."""
        self._learn("decode", s.t, s.tpot_p90_s, s.num_tpot)
        if None not in (s.queue_mean_s, s.prefill_mean_s, s.ttft_mean_s):
            self._learn("prefill", s.t, s.prefill_mean_s, s.num_prefilled)
        self.tpot_p90_s.add(s.t, s.tpot_p90_s)
        self.slots.add(s.t, s.slot_occupancy)
        self.pages.add(s.t, s.page_occupancy)
        self.num_tpot += s.num_tpot
        if None not in (s.queue_mean_s, s.prefill_mean_s, s.ttft_mean_s):
            self.queue_s.add(s.t, s.queue_mean_s)
            self.prefill_s.add(s.t, s.prefill_mean_s)
            self.ttft_s.add(s.t, s.ttft_mean_s)
            self.num_prefilled += s.num_prefilled

    def utilisation(self) -> float | None:
        """Prefill's utilisation as the M/D/1 queue that explains W and S; None before
        enough data."""
        if self.num_prefilled < self.min_samples:
            return None
        wait, service = self.queue_s.value, self.prefill_s.value
        return 2 * wait / (service + 2 * wait) if service + wait > 0 else 0.0

    def factor(self, role: str, devices: int, devices_after: int) -> float | None:
        """By how much `role`'s ("prefill" or "decode") pressure would multiply were it
        served on `devices_after` devices instead of `devices` (math.inf: it could not
        keep up); None while the role has fewer than `min_samples` measured requests."""
        if min(devices, devices_after) < 1:
            raise ValueError(f"devices must be >= 1, got {devices} -> {devices_after}")
        ratio = devices / devices_after
        slower = ratio ** self.efficiency                 # time per unit of work, after / now
        if role == "decode":
            return self._decode_factor(ratio, slower)
        if role == "prefill":
            return self._prefill_factor(slower)
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")

    def _decode_factor(self, ratio: float, slower: float) -> float | None:
        if self.num_tpot < self.min_samples:
            return None
        tpot = self.tpot_p90_s.value / self.slo_tpot_s
        occupancy = max(self.slots.value, self.pages.value) / self.occupancy_high
        now = max(tpot, occupancy)
        return max(tpot * slower, occupancy * ratio) / now if now > 0 else ratio

    def _prefill_factor(self, slower: float) -> float | None:
        rho = self.utilisation()
        if rho is None:
            return None
        wait, service = self.queue_s.value, self.prefill_s.value
        rest = max(0.0, self.ttft_s.value - wait - service)
        now = wait + service + rest
        rho_after, service_after = rho * slower, service * slower
        if rho_after >= 1:
            return math.inf
        wait_after = rho_after * service_after / (2 * (1 - rho_after))
        return (wait_after + service_after + rest) / now if now > 0 else slower
