"""`--plot` of `python -m jaxpd.bench`: TTFT and ITL CDFs per run, attainment vs rate.

matplotlib is optional (the `bench` extra); without it `--plot` fails up front with
the install command, before any benchmark runs.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from jaxpd.metrics import RequestTimeline


def require_matplotlib():
    """The pyplot module (Agg backend: files only, no display needed), or SystemExit."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'jaxpd[bench]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values) * 1e3)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_runs(timelines: Mapping[str, Sequence[RequestTimeline]], reports: Sequence[dict],
              path: str) -> None:
    """Write the figure: TTFT CDF, ITL CDF and, for a sweep, attainment vs rate."""
    plt = require_matplotlib()
    rates = sorted({r["rate"] for r in reports})
    sweep = len(rates) > 1
    elastic = [r for r in reports if r.get("engine_stats", {}).get("split_timeline")]
    panels = 2 + sweep + bool(elastic)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5))
    ttft_ax, itl_ax = axes[0], axes[1]
    for name, runs in timelines.items():
        _cdf(ttft_ax, [t.ttft for t in runs if t.ttft is not None], name)
        _cdf(itl_ax, [gap for t in runs for gap in t.itls], name)
    for ax, what in ((ttft_ax, "TTFT"), (itl_ax, "ITL")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if what == "TTFT" else "token gaps"))
        ax.set_title(f"{what} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if sweep:
        ax = axes[2]
        for backend in dict.fromkeys(r["backend"] for r in reports):
            points = sorted((r["rate"], r["slo_attainment"]) for r in reports
                            if r["backend"] == backend and r["slo_attainment"] is not None)
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o",
                    label=backend)
        ax.axhline(90, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title("attainment vs rate (goodput target 90%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if elastic:
        from jaxpd.bench.elastic import plot_split
        plot_split(axes[-1], elastic)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
