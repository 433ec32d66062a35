"""`--elastic`: the split controller acting on an elastic mesh in this process, or, on a
router, on the deployment's workers (`serving.router_split.RouterSplit` gives the same
`prepare` / `resplit` / `split`, counted in workers, one switched per decision).

Every `interval_s` the serving metrics, as /metrics renders them, become `Signals`
(`LiveSignals`: TTFT and TPOT p90 within the window, slot and page occupancy, the
prefill queue); the `SplitController` decides, with its hysteresis, sustain and dwell
time. A decision first prepares the new split (built and compiled while the old one
serves), then re-splits (`jaxpd.engine.elastic`); each is logged with its reason and
counted (`jaxpd_resplits_total`; the split now is the `jaxpd_prefill_devices` and
`jaxpd_decode_devices` gauges). A move the controller's latency model vetoed is logged
with its prediction (`SplitController.vetoes`) and counted (`count`:
`jaxpd_split_vetoes_total`); the model's efficiency learnt from a move is logged. A re-split that fails is logged and the
controller is told the split it really has; a failure that stops the engine ends the driver.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from jaxpd.plan.controller import Decision, Split, SplitController
from jaxpd.plan.live import LiveSignals

_log = logging.getLogger(__name__)


class ElasticDriver:
    """`render()`: the serving metrics' Prometheus text; `resplit(prefill)` and
    `prepare(prefill)`: the engine's (`LLM.resplit`, `LLM.prepare_resplit`);
    `split()`: the split now."""

    def __init__(self, controller: SplitController, render: Callable[[], str],
                 prepare: Callable[[int], object], resplit: Callable[[int], object],
                 split: Callable[[], Split], interval_s: float = 5.0,
                 say: Callable[[str], None] = _log.info,
                 clock: Callable[[], float] = time.monotonic,
                 count: Callable[..., None] = lambda **_: None):
        if not interval_s > 0:
            raise ValueError(f"elastic_interval_s must be > 0, got {interval_s}")
        self.controller, self.render, self.interval_s = controller, render, interval_s
        self._prepare, self._resplit, self._split = prepare, resplit, split
        self.say, self.clock, self.count = say, clock, count
        self.live = LiveSignals()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> Decision | None:
        """One observation; acts on a decision. Returns it (None: no move)."""
        num_vetoes, model = self.controller.num_vetoes, self.controller.model
        num_learnt = len(model.learnt)
        decision = self.controller.observe(self.live.observe(self.clock(), self.render()))
        if self.controller.num_vetoes > num_vetoes:
            self.count(split_vetoes=self.controller.num_vetoes - num_vetoes)
            self.say(f"elastic: {self.controller.vetoes[-1]}")
        if len(model.learnt) > num_learnt:
            self.say(f"elastic: the last move measured a scaling efficiency of "
                     f"{model.learnt[-1]:.2f}; the latency model now uses {model.efficiency:.2f}")
        if decision is None:
            return None
        self.say(f"elastic: {decision.old} -> {decision.new}: {decision.reason}")
        try:
            self._prepare(decision.new.prefill)
            self._resplit(decision.new.prefill)
        except ValueError as e:              # a split this mesh cannot take: keep serving
            self.say(f"elastic: re-split to {decision.new} refused: {e}")
            self.controller.restore(self._split())
        return decision

    def start(self) -> "ElasticDriver":
        self._thread = threading.Thread(target=self._run, name="jaxpd-elastic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except RuntimeError as e:        # the engine is shut down or failed
                self.say(f"elastic: stopped: {e}")
                return
            except Exception:                # never a silent death: say it, keep watching
                _log.exception("elastic: an observation failed")
