"""The state behind the OpenAI-compatible routes (`jaxpd.serving.http`): the front end,
admission, latency histograms, the requests in flight, draining, and /health's numbers.

Every HTTP request becomes one engine request per sample (`n`) per prompt, admitted
together or not at all. Their events go to one `AsyncOutputs` on the server's event
loop (the engine's thread hands them over without blocking), where `deltas` turns them
into text: no thread per request. What blocks -- tokenizing, submitting, /health and
/metrics -- runs on `_PREP_THREADS` threads (`jaxpd-http-prep`).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import Request as HttpRequest

from jaxpd.errors import QueueFull
from jaxpd.output_sink import MAX_BUFFERED, AsyncOutputs
from jaxpd.outputs import RequestMetrics, StreamDelta
from jaxpd.parsing.reasoning import reasoning_parser_for
from jaxpd.parsing.tool_calls import tool_parser_for
from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.serving import openai_api as api
from jaxpd.serving.admission import AdmissionController
from jaxpd.serving.pool import ShrinkingThreadPool
from jaxpd.serving.prometheus import ServingMetrics
from jaxpd.validation import default_max_prompt_bytes

if TYPE_CHECKING:
    from jaxpd.frontend import Frontend

_PREP_THREADS = 4          # tokenizing and submitting: short blocking steps
MAX_IN_FLIGHT = 4096       # requests in flight (the launcher passes --max_queued)


class OpenAIService:
    """The state behind the routes: the front end (None until `attach`), admission,
    latency histograms, the requests in flight and the draining flag.

    `admission` and `metrics` may be shared with the gRPC server of the same process
    (one TTFT estimate, one set of histograms); `base_stats` then is that server's
    `stats`, to which the counts of HTTP requests are added for /metrics.
    `max_concurrent`: requests in flight at once (beyond it 429); below it, what the
    front end cannot run yet waits in its own bounded queue (`max_queued`).
    `max_buffered`: events of one request the client has not read yet; past it the
    request aborts (`SLOW_READER`). `tool_call_parser`, `reasoning_parser`: how chat
    outputs are split (`jaxpd.parsing`; "auto": chosen from the chat template)."""

    def __init__(self, role: str = "single", model_names: tuple[str, ...] = (),
                 admission: AdmissionController | None = None,
                 metrics: ServingMetrics | None = None,
                 base_stats: Callable[[], dict] | None = None,
                 max_concurrent: int = MAX_IN_FLIGHT, max_body_bytes: int | None = None,
                 max_buffered: int = MAX_BUFFERED, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto"):
        tool_parser_for(tool_call_parser, None)      # ValueError for an unknown name
        reasoning_parser_for(reasoning_parser, None)
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.role = role
        self.admission = admission or AdmissionController()
        self.metrics = metrics or ServingMetrics()
        self.max_concurrent, self.max_buffered = max_concurrent, max_buffered
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.pool = ShrinkingThreadPool(_PREP_THREADS, "jaxpd-http-prep")
        self._model_names = tuple(n for n in model_names if n)
        self._base_stats = base_stats
        self._max_body_bytes = max_body_bytes
        self.frontend: Frontend | None = None
        self.serving = False
        self.draining = False
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._in_flight: dict[str, tuple[Request, int]] = {}
        self.num_queue_full = 0
        self.num_rpc_limit = 0

    # ---- lifecycle ----

    def attach(self, frontend: Frontend) -> None:
        self.frontend, self.serving = frontend, True

    def close(self) -> None:
        self.pool.shutdown(wait=False)

    def abort_all(self, reason: str) -> None:
        with self._lock:
            live = [r for r, _ in self._in_flight.values()]
        for r in live:
            self.frontend.abort(r.request_id, reason)

    def wait_done(self, timeout_s: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: not self._in_flight, timeout=timeout_s)

    # ---- names, limits, stats ----

    @property
    def model_id(self) -> str:
        if self._model_names:
            return self._model_names[0]
        path = self.frontend.model_path
        return os.path.basename(path.rstrip("/\\")) or path

    def check_model(self, name: str) -> None:
        accepted = {self.model_id, self.frontend.model_path, *self._model_names}
        if name not in accepted:
            raise api.ApiError(404, f"model {name!r} is not served here; this server serves "
                                    f"{self.model_id!r}", param="model", code="model_not_found")

    @property
    def max_body_bytes(self) -> int:
        if self._max_body_bytes is not None:
            return self._max_body_bytes
        # room for the prompt's JSON escaping and the other fields
        max_prompt_len = self.frontend.config.max_prompt_len if self.frontend else 1 << 16
        return 2 * default_max_prompt_bytes(max_prompt_len) + 64 * 1024

    def stats(self) -> dict:
        """The stats /metrics renders: the base stats plus HTTP's own counts."""
        if self._base_stats is not None:
            stats = dict(self._base_stats())
        else:
            stats = dict(self.frontend.stats()) if self.frontend is not None else {}
            stats["rejections_slo"] = self.admission.num_rejected
            stats["prefill_s_per_token"] = self.admission.s_per_token
        with self._lock:
            stats["requests_in_flight"] = stats.get("requests_in_flight", 0) + len(self._in_flight)
            stats["rejections_queue_full"] = (stats.get("rejections_queue_full", 0)
                                              + self.num_queue_full)
            stats["rejections_rpc_limit"] = (stats.get("rejections_rpc_limit", 0)
                                             + self.num_rpc_limit)
        stats["rejections"] = (stats["rejections_queue_full"] + stats["rejections_rpc_limit"]
                               + stats.get("rejections_slo", 0))
        return stats

    def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health."""
        fe = self.frontend
        if self.draining:
            status = "draining"
        elif fe is None or not self.serving:
            status = "starting"
        elif fe.failure() is not None:
            status = "failed"
        else:
            status = "ok"
        body = {"status": status, "role": self.role, "mesh": None, "queue_waiting": 0,
                "slots_active": 0, "slots_total": 0, "pages_used": 0, "pages_total": 0}
        if fe is not None:
            stats = dict(fe.stats())
            body.update(_occupancy(stats))
            body["fingerprint"] = (fe.fingerprint or "")[:12]
            if stats.get("problems"):       # a router: why some workers cannot serve
                body["problems"] = list(stats["problems"])
            if body["mesh"] is None:
                body["mesh"] = str(fe.config.mesh)
        return (200 if status == "ok" else 503), body

    # ---- a request's life ----

    def require_frontend(self) -> Frontend:
        if self.frontend is None or not self.serving:
            raise api.unavailable("the model is still loading" if self.frontend is None
                                  else "no back end can serve now")
        if self.draining:
            raise api.unavailable("the server is shutting down")
        error = self.frontend.failure()
        if error is not None:
            raise api.unavailable(f"the engine failed: {error!r}")
        return self.frontend

    async def run(self, fn: Callable, *args):
        """`fn(*args)` on the service's threads (it blocks: tokenizing, submitting)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def start(self, prompts: list[list[int]], params: SamplingParams,
              loop: asyncio.AbstractEventLoop) -> tuple[list[Request], AsyncOutputs]:
        """Build, admit and submit every sample of every prompt, or none (blocking: run
        it off the event loop); their events go to the `AsyncOutputs` returned, on
        `loop`. Requests in choice order: prompt-major, `n` per prompt."""
        fe = self.require_frontend()
        requests = [r for ids in prompts
                    for r in fe.make_requests(prompt_token_ids=ids, sampling_params=params)]
        sinks = AsyncOutputs(loop, len(requests), self.max_buffered)
        for r, sink in zip(requests, sinks.sinks):
            r.events = sink
        submitted = []
        try:
            for r in requests:
                self._start_one(fe, r)
                submitted.append(r)
        except BaseException:
            for r in submitted:
                self.finish(r, "a sibling sample was refused")
            raise
        return requests, sinks

    def _start_one(self, fe: Frontend, r: Request) -> None:
        with self._lock:
            if len(self._in_flight) >= self.max_concurrent:
                self.num_rpc_limit += 1
                raise api.busy(f"{self.max_concurrent} requests are in flight")
            ahead = sum(q.num_tokens for q, _ in self._in_flight.values()
                        if q.state in (State.WAITING, State.PREFILLING))
        refusal = self.admission.check(ahead, len(r.prompt_ids))
        if refusal is not None:
            raise api.busy(refusal)
        with self._lock:
            self._in_flight[r.request_id] = (r, ahead)
        try:
            fe.submit(r)
        except QueueFull as e:
            self._forget(r)
            with self._lock:
                self.num_queue_full += 1
            raise api.busy(str(e)) from None
        except RuntimeError as e:   # the engine failed or shut down
            self._forget(r)
            raise api.unavailable(str(e)) from None
        except ValueError:
            self._forget(r)
            raise
        if self.draining:   # stop began while it was submitted: abort_all may have missed it
            fe.abort(r.request_id, "shutdown")

    def finish(self, r: Request, reason: str = "cancelled") -> None:
        """The client is done with `r`: abort it if it still runs; the first time, forget
        it and learn from it if it finished."""
        if not r.is_final:
            self.frontend.abort(r.request_id, "shutdown" if self.draining else reason)
        with self._done:
            entry = self._in_flight.pop(r.request_id, None)
            self._done.notify_all()
        if entry is not None and r.finish_reason in ("stop", "length"):
            m = RequestMetrics.of(r)
            self.metrics.observe(m)
            self.admission.observe(entry[1], len(r.prompt_ids), m)

    def _forget(self, r: Request) -> None:
        with self._done:
            self._in_flight.pop(r.request_id, None)
            self._done.notify_all()

    async def deltas(self, requests: list[Request], outputs: AsyncOutputs
                     ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(index, delta) of `requests` as their events reach `outputs` (detokenised on
        the loop: a few tokens at a time); ends when every request has ended."""
        makers = [self.frontend.delta_maker(r) for r in requests]
        live = len(requests)
        while live:
            i, (ids, finish) = await outputs.get()
            yield i, makers[i](ids, finish)
            live -= finish is not None

    @contextlib.asynccontextmanager
    async def watching(self, http: HttpRequest, requests: list[Request]):
        """While the body runs, a client that goes away aborts `requests` at once (the
        body is read already, so the next ASGI message is the disconnect)."""
        async def watch() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass
            for r in requests:
                self.finish(r, "client disconnected")

        task = asyncio.get_running_loop().create_task(watch())
        try:
            yield
        finally:
            task.cancel()


def _occupancy(stats: dict) -> dict:
    """/health's numbers from a front end's stats: an engine's own, or the sum over a
    router's live workers (slots and pages on decode workers, the queue on all)."""
    out = {"mesh": stats.get("mesh") or None}
    if "workers" in stats:
        workers = [w for ws in stats["workers"].values() for w in ws]
        decode = stats["workers"].get("decode", [])
        out["queue_waiting"] = sum(w.get("queue", 0) for w in workers)
        out["slots_total"] = sum(w.get("slots_total", 0) for w in decode)
        out["slots_active"] = out["slots_total"] - sum(w.get("free_slots", 0) for w in decode)
        out["pages_total"] = sum(w.get("pages_total", 0) for w in decode)
        out["pages_used"] = out["pages_total"] - sum(w.get("free_pages", 0) for w in decode)
        return out
    for key in ("queue_waiting", "slots_active", "slots_total", "pages_used", "pages_total"):
        out[key] = int(stats.get(key, 0))
    return out
