"""The bench's `elastic=N` backend: an in-process engine whose split the `--elastic`
driver (`plan.driver.ElasticDriver`) moves during each run, as it would while serving,
and what it did: every decision with its reason, and the split over time beside the
prefill queue and the decode slots in use (`--plot` draws it)."""
from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

from jaxpd.bench.args import nonnegative_float, positive_float, positive_int
from jaxpd.bench.driver import BenchRequest, EngineBackend, RunResult
from jaxpd.outputs import RequestMetrics
from jaxpd.plan.controller import Split, SplitController
from jaxpd.plan.driver import ElasticDriver
from jaxpd.serving.prometheus import ServingMetrics


class ElasticBackend(EngineBackend):
    """`EngineBackend` on an elastic mesh, its controller acting during `run`: each
    finished request feeds the TTFT/TPOT histograms the driver reads, as /metrics
    would; `interval_s`, `sustain_s`, `dwell_s` and `step` as `--elastic_*` of the
    launcher (the bench's defaults are shorter: its phases last tens of seconds)."""

    def __init__(self, model_dir: str, mesh: str, engine_options: dict,
                 warmup_requests: Sequence[BenchRequest], warm_prompt_lens: Sequence[int],
                 compile_ahead: bool, *, slo_ttft_s: float, slo_tpot_s: float,
                 interval_s: float, sustain_s: float, dwell_s: float, step: int = 1):
        super().__init__(model_dir, mesh, engine_options, warmup_requests, warm_prompt_lens,
                         compile_ahead)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.interval_s, self.sustain_s, self.dwell_s = interval_s, sustain_s, dwell_s
        self.step = step
        self.metrics = ServingMetrics()

    def split(self) -> Split:
        spec = self.llm.engine.config.mesh
        return Split(spec.prefill_tp, spec.decode_dp)

    def finished(self, request) -> None:
        if request.finish_reason in ("stop", "length"):
            self.metrics.observe(RequestMetrics.of(request))

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        controller = SplitController(self.split(), self.slo_ttft_s, self.slo_tpot_s,
                                     step=self.step, sustain_s=self.sustain_s,
                                     dwell_s=self.dwell_s, smoothing_s=2 * self.interval_s)
        origin, timeline = time.monotonic(), []

        def render() -> str:
            stats = self.llm.stats()
            timeline.append({"t_s": time.monotonic() - origin,
                             "prefill_devices": stats["prefill_devices"],
                             "decode_devices": stats["decode_devices"],
                             "queue_waiting": stats["queue_waiting"],
                             "slots_active": stats["slots_active"]})
            return self.metrics.render(stats)

        driver = ElasticDriver(controller, render, self.llm.prepare_resplit, self.llm.resplit,
                               self.split, self.interval_s,
                               say=lambda m: print(f"[{self.name}] {m}", file=sys.stderr))
        driver.start()
        try:
            result = super().run(requests, on_done)
        finally:
            driver.stop()
        result.stats["split_timeline"] = timeline
        result.stats["resplit_decisions"] = [
            {"t_s": d.t - origin, "old": str(d.old), "new": str(d.new), "reason": d.reason}
            for d in controller.decisions]
        result.stats["resplit_vetoes"] = [
            {"t_s": v.t - origin, "split": str(v.split), "wanted": str(v.wanted),
             "reason": v.reason} for v in controller.vetoes]
        # The next run (another rate) starts from the split this one left.
        return result


def add_elastic_flags(s) -> None:
    """The bench's flags of an `elastic=N` mesh's controller (on argument group `s`)."""
    s.add_argument("--elastic_interval_s", type=positive_float, default=1.0,
                   help="an elastic=N mesh: seconds between its controller's observations")
    s.add_argument("--elastic_sustain_s", type=nonnegative_float, default=3.0,
                   help="an elastic=N mesh: how long a move must be wanted before it is made")
    s.add_argument("--elastic_step", type=positive_int, default=1,
                   help="an elastic=N mesh: devices one move takes from a role")
    s.add_argument("--elastic_dwell_s", type=nonnegative_float, default=10.0,
                   help="an elastic=N mesh: the least time between two moves")


def format_decisions(runs: list[dict]) -> str:
    """Every elastic run's moves and the moves its latency model vetoed, one line each,
    in time order."""
    lines = []
    for r in runs:
        stats = r.get("engine_stats", {})
        moves = [(d["t_s"], f"{d['old']} -> {d['new']}: {d['reason']}")
                 for d in stats.get("resplit_decisions", [])]
        held = [(v["t_s"], f"held {v['split']} (not {v['wanted']}): {v['reason']}")
                for v in stats.get("resplit_vetoes", [])]
        lines += [f"{r['name']}: t={t:.1f} s {line}" for t, line in sorted(moves + held)]
    return "\n".join(lines)


def plot_split(ax, runs: list[dict]) -> None:
    """The split over time against the prefill queue and the decode slots in use."""
    for r in runs:
        points = r.get("engine_stats", {}).get("split_timeline", [])
        if not points:
            continue
        t = [p["t_s"] for p in points]
        ax.step(t, [p["prefill_devices"] for p in points], where="post",
                label=f"{r['name']}: prefill devices")
        ax.plot(t, [p["queue_waiting"] for p in points], alpha=0.6,
                label=f"{r['name']}: prefill queue")
        ax.plot(t, [p["slots_active"] for p in points], alpha=0.6,
                label=f"{r['name']}: decode slots in use")
    ax.set_xlabel("time (s)")
    ax.set_title("elastic split over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
