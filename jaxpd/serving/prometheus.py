"""Prometheus text exposition of the serving metrics, over a stdlib HTTP endpoint.

`ServingMetrics` holds the latency histograms (observed from each finished request)
and renders them together with a snapshot of the server's stats dict (gauges for
occupancy, counters for the engine's monotonic counts). `MetricsEndpoint` serves
that text at /metrics from one named daemon thread (`jaxpd-metrics`) running a
`ThreadingHTTPServer`; `close()` shuts it down and joins the thread.
"""
from __future__ import annotations

import http.server
import threading
from typing import Callable

from jaxpd.metrics import LatencyHistogram
from jaxpd.outputs import RequestMetrics
from jaxpd.stats import exported

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The engine's gauges and counters come from `EngineStats` (kind, name and help per
# field); these are the server's own.
_SERVER_GAUGES = (
    ("requests_in_flight", "jaxpd_requests_in_flight", "gauge",
     "Requests the server is serving now."),
)


class ServingMetrics:
    """TTFT, TPOT and ITL histograms, plus rendering of a stats snapshot."""

    def __init__(self):
        self.ttft = LatencyHistogram()
        self.tpot = LatencyHistogram()
        self.itl = LatencyHistogram()

    def observe(self, metrics: RequestMetrics) -> None:
        """Record one finished request's latencies."""
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.tpot_s is not None:
            self.tpot.observe(metrics.tpot_s)
        for gap in metrics.itl_s:
            self.itl.observe(gap)

    def render(self, stats: dict) -> str:
        """Everything in Prometheus text format; keys missing from `stats` are skipped."""
        parts = [self.ttft.render("jaxpd_ttft_seconds", "Time to first token."),
                 self.tpot.render("jaxpd_tpot_seconds",
                                  "Mean time per output token after the first."),
                 self.itl.render("jaxpd_itl_seconds", "Gap between consecutive output tokens.")]
        for key, name, kind, help in exported() + list(_SERVER_GAUGES):
            if stats.get(key) is not None:
                parts.append(_sample(name, kind, help, stats[key]))
        rejections = [f'jaxpd_rejections_total{{reason="{reason}"}} '
                      f'{stats.get(f"rejections_{reason}", 0)}' for reason in ("queue_full", "slo")]
        parts.append("# HELP jaxpd_rejections_total Requests refused with RESOURCE_EXHAUSTED.\n"
                     "# TYPE jaxpd_rejections_total counter\n" + "\n".join(rejections) + "\n")
        return "".join(parts)


def _sample(name: str, kind: str, help: str, value) -> str:
    return f"# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {float(value)!r}\n"


class MetricsEndpoint:
    """GET /metrics -> `render()`; anything else 404. Port 0 picks a free port."""

    def __init__(self, render: Callable[[], str], host: str = "127.0.0.1", port: int = 0):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                # Scrapes every few seconds would flood stderr; errors still go through
                # send_error's own response.
                pass

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="jaxpd-metrics",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, close the socket, join the thread. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
