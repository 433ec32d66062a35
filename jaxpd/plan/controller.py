"""The elastic split's controller: live signals in; out, now and then, a
decision to move devices between prefill and decode, with its reason.

Pure Python, no clock of its own (each `Signals` carries its time), so a recorded or
synthetic trace replays exactly. What it must never do is flap: a role switch drains
a worker and recompiles, so a wrong move costs far more than a late one. Hence:
- each signal is smoothed (an exponential moving average per second of trace time);
- a role is *overloaded* at `high` x its SLO (or slot/page occupancy), *has room* below
  `low` x; between the two it is neither (the hysteresis band);
- a move is wanted only when one role is overloaded and the other has room (both
  overloaded is a capacity problem a re-split cannot solve), and made only once it has
  been wanted continuously for `sustain_s`;
- after a move nothing moves for `dwell_s`, and no role drops below `min_devices`;
- a move that is due is first put to the live latency model (`split_model.SplitModel`,
  refreshed from every observation): it is vetoed when the role giving devices would be
  over `high` after it, or when the role receiving them would stay over `high` and gain
  less than `MIN_GAIN` of its pressure (a role at 2x its SLO may need several moves, and
  each that helps must be allowed). A veto is kept in `vetoes` with its reason, and the
  move must then be wanted for `sustain_s` again. Without enough measured requests the
  model predicts nothing and vetoes nothing.

Pressure of each role (1.0 = at its SLO):
  prefill  max(TTFT p90 / slo_ttft, predicted TTFT / slo_ttft); with neither, 0 if
           the prefill queue is empty, else unchanged (no news)
  decode   max(TPOT p90 / slo_tpot, slot occupancy / occupancy_high,
               page occupancy / occupancy_high)
"""
from __future__ import annotations

import collections
import dataclasses
import math

from jaxpd.plan.signals import Signals
from jaxpd.plan.split_model import SplitModel

MIN_GAIN = 0.1      # a receiving role left over `high` must lose at least this share


@dataclasses.dataclass(frozen=True)
class Split:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"prefill={self.prefill},decode={self.decode}"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The pressures the latency model predicts after a move to `new` (None: not enough
    measured for that role; math.inf: it could not keep up)."""
    new: Split
    prefill: float | None
    decode: float | None

    def __str__(self) -> str:
        x = lambda p: "-" if p is None else f"{p:.2f}x"          # noqa: E731
        return f"{self.new}: prefill {x(self.prefill)}, decode {x(self.decode)}"


@dataclasses.dataclass(frozen=True)
class Veto:
    """A move that was due and that the latency model refused, with why."""
    t: float
    split: Split
    wanted: Split
    reason: str

    def __str__(self) -> str:
        return f"hold {self.split} (not {self.wanted}): {self.reason}"


@dataclasses.dataclass(frozen=True)
class Decision:
    t: float
    old: Split
    new: Split
    reason: str

    @property
    def direction(self) -> str:
        return "to_prefill" if self.new.prefill > self.old.prefill else "to_decode"


class SplitController:
    """Feed it `Signals` in time order (`observe`); it returns a `Decision` when the
    split should change, else None. `split` is the split now; `step` devices move at a
    time (a decode dp shard's size, say). `efficiency` and `min_samples` are the latency
    model's (`SplitModel`)."""

    def __init__(self, split: Split, slo_ttft_s: float, slo_tpot_s: float, *, step: int = 1,
                 min_devices: int = 1, high: float = 1.0, low: float = 0.6,
                 occupancy_high: float = 0.9, sustain_s: float = 30.0, dwell_s: float = 120.0,
                 smoothing_s: float = 10.0, efficiency: float = 1.0, min_samples: int = 20):
        if not (slo_ttft_s > 0 and slo_tpot_s > 0):
            raise ValueError("slo_ttft_s and slo_tpot_s must be > 0")
        if not 0 < low < high:
            raise ValueError(f"need 0 < low < high, got low={low}, high={high}")
        if step < 1 or min_devices < 1 or min(split.prefill, split.decode) < min_devices:
            raise ValueError(f"step and min_devices must be >= 1 and the split {split} must "
                             f"give each role at least min_devices={min_devices}")
        self.split, self.step, self.min_devices = split, step, min_devices
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.high, self.low, self.occupancy_high = high, low, occupancy_high
        self.sustain_s, self.dwell_s, self.smoothing_s = sustain_s, dwell_s, smoothing_s
        self.prefill_pressure = self.decode_pressure = None
        self._last_t: float | None = None
        self._last_switch_t: float | None = None
        self._wanted: tuple[str, float] | None = None    # (direction, since)
        self.decisions: list[Decision] = []
        self.model = SplitModel(slo_tpot_s, occupancy_high, smoothing_s, efficiency, min_samples)
        self.vetoes: collections.deque[Veto] = collections.deque(maxlen=1000)
        self.num_vetoes = 0

    def restore(self, split: Split) -> None:
        """A decided move did not happen: the split is `split`, and nothing is learnt."""
        self.split = split
        self.model.moved((split.prefill, split.decode), (split.prefill, split.decode))

    def pressures(self, s: Signals) -> tuple[float | None, float]:
        """This observation's raw (prefill, decode) pressure. With no TTFT measured or
        predicted, prefill is 0 when nothing waits for it, else None: no news (a prefill
        so slow that nothing finished within the window must not read as idle)."""
        prefill = max([x / self.slo_ttft_s for x in (s.ttft_p90_s, s.predicted_ttft_s)
                       if x is not None], default=None if s.prefill_queue else 0.0)
        decode = max([s.tpot_p90_s / self.slo_tpot_s] if s.tpot_p90_s is not None else [],
                     default=0.0)
        decode = max(decode, s.slot_occupancy / self.occupancy_high,
                     s.page_occupancy / self.occupancy_high)
        return prefill, decode

    def observe(self, s: Signals) -> Decision | None:
        if self._last_t is not None and s.t < self._last_t:
            raise ValueError(f"signals out of order: t={s.t} after t={self._last_t}")
        self.model.observe(s)
        prefill, decode = self.pressures(s)
        if self._last_t is None:
            self.prefill_pressure, self.decode_pressure = prefill or 0.0, decode
            self._started_t = s.t
        else:
            keep = math.exp(-(s.t - self._last_t) / self.smoothing_s)
            if prefill is not None:
                self.prefill_pressure = keep * self.prefill_pressure + (1 - keep) * prefill
            self.decode_pressure = keep * self.decode_pressure + (1 - keep) * decode
        self._last_t = s.t
        want = self._wanted_direction()
        if want is None:
            self._wanted = None
            return None
        if self._wanted is None or self._wanted[0] != want:
            self._wanted = (want, s.t)
        since = self._wanted[1]
        settled_t = self._started_t if self._last_switch_t is None else self._last_switch_t
        if s.t - since < self.sustain_s or s.t - settled_t < self.dwell_s:
            return None
        prediction = self.predict(want)
        veto = self._veto(want, prediction)
        if veto is not None:
            self.vetoes.append(Veto(s.t, self.split, prediction.new, veto))
            self.num_vetoes += 1
            self._wanted = (want, s.t)        # wanted for sustain_s again before a retry
            return None
        return self._switch(s.t, want, since, prediction)

    def predict(self, direction: str) -> Prediction:
        """The latency model's pressures after `step` devices move `direction`
        ("to_prefill" or "to_decode"): each role's smoothed pressure now times its
        `SplitModel.factor`."""
        sign = 1 if direction == "to_prefill" else -1
        new = Split(self.split.prefill + sign * self.step, self.split.decode - sign * self.step)
        if min(new.prefill, new.decode) < 1:
            return Prediction(new, None, None)
        after = {}
        for role, pressure in (("prefill", self.prefill_pressure),
                               ("decode", self.decode_pressure)):
            factor = self.model.factor(role, getattr(self.split, role), getattr(new, role))
            after[role] = None if factor is None or pressure is None else (
                math.inf if math.isinf(factor) else pressure * factor)
        return Prediction(new, **after)

    def _veto(self, direction: str, prediction: Prediction) -> str | None:
        """Why the move should not be made (None: make it, or nothing predicted)."""
        busy, idle = ("prefill", "decode") if direction == "to_prefill" else ("decode", "prefill")
        pressure = {"prefill": self.prefill_pressure, "decode": self.decode_pressure}
        giver, receiver = getattr(prediction, idle), getattr(prediction, busy)
        if giver is not None and giver > self.high:
            return (f"{idle} would be at {giver:.2f}x its SLO with {self.step} device(s) "
                    f"fewer (over {self.high:g}x); predicted {prediction}")
        if receiver is not None and receiver >= self.high and \
                receiver > (1 - MIN_GAIN) * pressure[busy]:
            return (f"{busy} would only go from {pressure[busy]:.2f}x to {receiver:.2f}x "
                    f"its SLO with {self.step} device(s) more; predicted {prediction}")
        return None

    def _wanted_direction(self) -> str | None:
        p, d = self.prefill_pressure, self.decode_pressure
        if p > self.high and d < self.low and self.split.decode - self.step >= self.min_devices:
            return "to_prefill"
        if d > self.high and p < self.low and self.split.prefill - self.step >= self.min_devices:
            return "to_decode"
        return None

    def _switch(self, t: float, direction: str, since: float,
                prediction: Prediction) -> Decision:
        old = self.split
        sign = 1 if direction == "to_prefill" else -1
        new = Split(old.prefill + sign * self.step, old.decode - sign * self.step)
        busy, idle = ("prefill", "decode") if sign > 0 else ("decode", "prefill")
        pressure = {"prefill": self.prefill_pressure, "decode": self.decode_pressure}
        reason = (f"{busy} at {pressure[busy]:.2f}x its SLO and {idle} at "
                  f"{pressure[idle]:.2f}x for {t - since:.0f} s: {self.step} device(s) "
                  f"{idle} -> {busy}")
        if (prediction.prefill, prediction.decode) != (None, None):
            reason += f"; predicted {prediction}"
        decision = Decision(t, old, new, reason)
        self.split, self._last_switch_t, self._wanted = new, t, None
        self.model.moved((old.prefill, old.decode), (new.prefill, new.decode))
        self.decisions.append(decision)
        return decision
