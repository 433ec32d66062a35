"""The serving metrics in Prometheus text format, at GET /metrics.

`ServingMetrics` holds the latency histograms (observed from each finished request).
`ServingCollector` is a `prometheus_client` collector: the histograms plus a snapshot of
the server's stats dict (gauges for occupancy, counters for the engine's monotonic
counts, each field's kind and help from `EngineStats`), rendered by
`prometheus_client.generate_latest` on every scrape.

`MetricsEndpoint` serves it from one named daemon thread (`jaxpd-metrics`) running an
asyncio loop (rendering on one more, `jaxpd-metrics-render`, which exits when idle), not
from `prometheus_client.start_http_server` (a `ThreadingHTTPServer`: a thread per
connection and no timeout, so 300 half-open connections made 300 threads). Here a
connection costs a coroutine; it must send its request within `timeout_s` and read the
answer within `timeout_s` again, or it is closed; beyond `max_connections` open at
once, new ones are closed at accept. A scrape is answered while slow clients wait.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxpd.metrics import LatencyHistogram
from jaxpd.outputs import RequestMetrics
from jaxpd.serving.pool import ShrinkingThreadPool
from jaxpd.stats import exported

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST_HEAD = 8192   # request line + headers; a scrape sends a few hundred bytes

# The engine's gauges and counters come from `EngineStats` (kind, name and help per
# field); these are the server's own.
_SERVER_GAUGES = (
    ("requests_in_flight", "jaxpd_requests_in_flight", "gauge",
     "Requests the server is serving now."),
)
REJECTION_REASONS = ("queue_full", "slo", "rpc_limit")


class ServingMetrics:
    """TTFT, TPOT and ITL histograms; and the queue wait and prefill time of requests
    whose TTFT they hold (the elastic split's latency model reads their means)."""

    def __init__(self):
        self.ttft = LatencyHistogram()
        self.tpot = LatencyHistogram()
        self.itl = LatencyHistogram()
        self.queue = LatencyHistogram()
        self.prefill = LatencyHistogram()

    def observe(self, metrics: RequestMetrics) -> None:
        """Record one finished request's latencies."""
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
            if metrics.queue_s is not None and metrics.prefill_s is not None:
                self.queue.observe(metrics.queue_s)
                self.prefill.observe(metrics.prefill_s)
        if metrics.tpot_s is not None:
            self.tpot.observe(metrics.tpot_s)
        for gap in metrics.itl_s:
            self.itl.observe(gap)

    def render(self, stats: dict) -> str:
        """Everything in Prometheus text format; keys missing from `stats` are skipped."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServingCollector(self, lambda: stats))
        return generate_latest(registry).decode()


class ServingCollector(Collector):
    """The histograms of `metrics` and the stats dict `stats()` returns at each scrape."""

    def __init__(self, metrics: ServingMetrics, stats: Callable[[], dict]):
        self._metrics, self._stats = metrics, stats

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        for hist, name, help in ((m.ttft, "jaxpd_ttft_seconds", "Time to first token."),
                                 (m.tpot, "jaxpd_tpot_seconds",
                                  "Mean time per output token after the first."),
                                 (m.itl, "jaxpd_itl_seconds",
                                  "Gap between consecutive output tokens."),
                                 (m.queue, "jaxpd_queue_seconds",
                                  "Wait from arrival to the start of the request's prefill."),
                                 (m.prefill, "jaxpd_prefill_seconds",
                                  "From the start of the request's prefill to its first token (its "
                                  "batch's time).")):
            buckets, total = hist.snapshot()
            yield HistogramMetricFamily(name, help, sum_value=total, buckets=[
                (floatToGoString(le), count) for le, count in buckets])
        stats = self._stats()
        for key, name, kind, help in exported() + list(_SERVER_GAUGES):
            if stats.get(key) is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help, value=float(stats[key]))
        rejections = CounterMetricFamily("jaxpd_rejections_total",
                                         "Requests refused with RESOURCE_EXHAUSTED.",
                                         labels=("reason",))
        for reason in REJECTION_REASONS:
            rejections.add_metric((reason,), float(stats.get(f"rejections_{reason}", 0)))
        yield rejections


class MetricsEndpoint:
    """GET /metrics -> the registry's text; another path 404, another method 405.
    Port 0 picks a free port (read `.port`)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 5.0, max_connections: int = 256):
        self._registry, self.timeout_s, self.max_connections = registry, timeout_s, max_connections
        self.num_open = 0
        self._handlers: set[asyncio.Task] = set()
        self._render_pool = ShrinkingThreadPool(1, "jaxpd-metrics-render")
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(
                self._serve, host, port, limit=_MAX_REQUEST_HEAD))
        except OSError:
            self._loop.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxpd-metrics",
                                        daemon=True)
        self._thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.num_open >= self.max_connections:
            writer.close()
            return
        self.num_open += 1
        self._handlers.add(asyncio.current_task())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
            writer.write(await self._answer(head))
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass   # a client too slow, gone, or sending too much: just close
        finally:
            self.num_open -= 1
            self._handlers.discard(asyncio.current_task())
            writer.close()

    async def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            return _response(400, b"malformed request line\n")
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"only GET is served here\n")
        if target.split(b"?", 1)[0] != b"/metrics":
            return _response(404, b"only /metrics is served here\n")
        # Off the loop: a stats snapshot may wait on locks (or, on a router, on workers).
        body = await asyncio.get_running_loop().run_in_executor(
            self._render_pool, generate_latest, self._registry)
        return _response(200, body, CONTENT_TYPE, with_body=method == b"GET")

    async def _close_all(self) -> None:
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    def close(self) -> None:
        """Stop serving, close every connection and the socket, join the thread. Idempotent."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._render_pool.shutdown(wait=True)


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              with_body: bool = True) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
    head = (f"HTTP/1.1 {status} {reason[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + (body if with_body else b"")
