"""`python -m jaxpd.bench --workload shift`: the report of each phase of a workload
whose length mix changes mid-run (`workload.make_shift_workload`), beside the whole
run's -- what an elastic prefill/decode split has to win, phase by phase."""
from __future__ import annotations

import numpy as np

from jaxpd.bench.driver import run_duration
from jaxpd.bench.workload import phase_of
from jaxpd.metrics import meets_slo, slo_attainment


def phase_reports(timelines, phases, slo_ttft: float, slo_tpot: float) -> list[dict]:
    """Per phase of a shift workload: its requests' SLO attainment, goodput and
    latencies."""
    out = []
    for p, phase in enumerate(phases):
        mine = [t for i, t in enumerate(timelines) if phase_of(phases, i) == p]
        ttfts = [t.ttft for t in mine if t.ttft is not None]
        tpots = [t.tpot for t in mine if t.tpot is not None]
        met = sum(meets_slo(t, slo_ttft, slo_tpot) for t in mine)
        out.append({"phase": p, "prompt_lens": phase.prompt_lens,
                    "output_lens": phase.output_lens, "num_requests": len(mine),
                    "slo_attainment": slo_attainment(mine, slo_ttft, slo_tpot),
                    # SLO-meeting requests per second, over the phase's first arrival
                    # to its last finish.
                    "goodput_rps": met / run_duration(mine),
                    "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
                    "tpot_p50_s": float(np.percentile(tpots, 50)) if tpots else None})
    return out


def format_phase_table(runs: list[dict]) -> str:
    """SLO attainment per phase (and overall), one row per run."""
    def phase_cell(p: dict) -> str:
        return (f"{100 * p['slo_attainment']:.0f}% {p['goodput_rps']:.2f}/s "
                f"{_ms(p['ttft_p50_s'])}/{_ms(p['tpot_p50_s'])}")

    names = [f"phase {p['phase']} {p['prompt_lens']}->{p['output_lens']}"
             for p in runs[0]["phases"]]
    rows = [f"{'run':<40}" + "".join(f"{n:>30}" for n in names) + f"{'overall':>10}",
            "(SLO attainment %, goodput in SLO-meeting requests/s, TTFT p50 / TPOT p50 ms)"]
    for r in runs:
        cells = "".join(f"{phase_cell(p):>30}" for p in r["phases"])
        rows.append(f"{r['name']:<40}{cells}{100 * r['slo_attainment']:>9.0f}%")
    return "\n".join(rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"
