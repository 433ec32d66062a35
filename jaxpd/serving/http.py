"""The OpenAI-compatible HTTP API over a front end (`LLM` or `Router`), with /health
and /metrics, served by uvicorn (FastAPI, the convention of vLLM and SGLang).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as Server-Sent
Events with `stream: true`, ending `data: [DONE]`; `stream_options.include_usage` adds
a last chunk with the usage), `GET /v1/models`, `GET /health`, `GET /metrics`.

Every field is mapped to what `SamplingParams` has (max_tokens / max_completion_tokens,
temperature, top_p, seed, and vLLM's top_k, stop_token_ids, ignore_eos). Nothing is
silently ignored: a field we do not know is a 400, and so is a known one asking for
what jaxpd cannot do yet (`n` > 1, `stop`, `logprobs`, penalties, `min_p` > 0, ...);
`user` alone is accepted and ignored (it only labels the caller). Errors have OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`: 400 bad field (`param` names
it), 404 unknown model, 413 a body over `max_body_bytes` (refused while it is read,
before any parsing), 429 with Retry-After when admission refuses (the engine's queue is
full, the predicted TTFT is over the SLO, or `max_concurrent` requests are running),
503 before `attach` (loading, compiling), while draining, or when the back end died.

Threads: uvicorn runs its event loop on one named thread (`jaxpd-http`); tokenizing
and submitting run on the loop's worker threads (`run_in_threadpool`), and each running
request has one `jaxpd-http-events` thread iterating the blocking `Frontend.events`
and handing events to the loop, so the loop never blocks; at most `max_concurrent` of
them. A client that goes away (the stream's generator is closed, or the disconnect is
seen while waiting) aborts its request, and the engine frees its slot and pages.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from jaxpd.errors import QueueFull
from jaxpd.models.tokenizer import IncrementalDecoder
from jaxpd.outputs import RequestMetrics
from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.serving import openai_api as api
from jaxpd.serving.admission import AdmissionController
from jaxpd.serving.prometheus import CONTENT_TYPE, ServingMetrics
from jaxpd.validation import check_text_size, default_max_prompt_bytes

if TYPE_CHECKING:
    from jaxpd.frontend import Frontend

_DISCONNECT_POLL_S = 0.5   # while waiting for a token, check the client is still there
_FINAL_MESSAGE_S = 2.0     # at stop, for aborted streams to send their last event
_START_TIMEOUT_S = 30.0


# ---- the service --------------------------------------------------------------------

class OpenAIService:
    """The state behind the routes: the front end (None until `attach`), admission,
    latency histograms, the requests in flight and the draining flag.

    `admission` and `metrics` may be shared with the gRPC server of the same process
    (one TTFT estimate, one set of histograms); `base_stats` then is that server's
    `stats`, to which the counts of HTTP requests are added for /metrics."""

    def __init__(self, role: str = "single", model_names: tuple[str, ...] = (),
                 admission: AdmissionController | None = None,
                 metrics: ServingMetrics | None = None,
                 base_stats: Callable[[], dict] | None = None,
                 max_concurrent: int = 128, max_body_bytes: int | None = None):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.role = role
        self.admission = admission or AdmissionController()
        self.metrics = metrics or ServingMetrics()
        self.max_concurrent = max_concurrent
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
            body.update(_occupancy(dict(fe.stats())))
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

    def start(self, ids: list[int], params: SamplingParams) -> Request:
        """Build, admit and submit (blocking: run it off the event loop)."""
        fe = self.require_frontend()
        r = fe.make_request(prompt_token_ids=ids, sampling_params=params)
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
        if self.draining:   # stop began while it was submitted: abort_all may have missed it
            fe.abort(r.request_id, "shutdown")
        return r

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

    async def events(self, r: Request, http: HttpRequest
                     ) -> AsyncIterator[tuple[list[int], str | None]]:
        """`Frontend.events(r)` without blocking the loop: a thread iterates it. Ends
        early (without a final event) when the client has gone away."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        fe = self.frontend

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):   # the loop is closed: nobody listens
                loop.call_soon_threadsafe(inbox.put_nowait, item)

        def pump() -> None:
            try:
                for event in fe.events(r):
                    put(event)
            except Exception as e:   # noqa: BLE001 -- handed to the loop, raised there
                put(e)

        threading.Thread(target=pump, name="jaxpd-http-events", daemon=True).start()
        while True:
            try:
                event = await asyncio.wait_for(inbox.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return
                continue
            if isinstance(event, Exception):
                raise event
            yield event
            if event[1] is not None:
                return


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


# ---- turning bodies into requests and responses -------------------------------------

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
                    "prompt", "prompt_token_ids", "token_ids", "messages", "request_id")


def _prompt_ids(svc: OpenAIService, body: api.CompletionBody | api.ChatBody) -> list[int]:
    """The prompt's token ids: given, tokenized, or the chat template's rendering."""
    fe = svc.require_frontend()
    if isinstance(body, api.ChatBody):
        messages = [api.flatten_content(m) for m in body.messages]
        text = fe.chat_prompt(messages)
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise api.bad(f"prompt: {len(prompt)} prompts in one request; more than one "
                              f"is not supported yet", "prompt", "unsupported_parameter")
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt:
                raise api.bad("prompt is empty", "prompt")
            if len(prompt) > fe.config.max_prompt_len:
                raise api.bad(f"prompt has {len(prompt)} tokens, more than "
                              f"max_prompt_len={fe.config.max_prompt_len}", "prompt")
            return list(prompt)
        text = prompt
    if not text:
        raise api.bad("prompt is empty", "prompt")
    if fe.tokenizer is None:
        raise api.bad("prompt: this model has no tokenizer.json; send token ids", "prompt")
    check_text_size(text, default_max_prompt_bytes(fe.config.max_prompt_len), "prompt")
    ids = fe.tokenizer.encode(text)
    if not ids:
        raise api.bad("prompt encodes to no tokens", "prompt")
    return ids


def _prepare(svc: OpenAIService, body: api.CompletionBody | api.ChatBody) -> Request:
    """Validate, tokenize, admit and submit (blocking)."""
    svc.require_frontend()
    svc.check_model(body.model)
    field = api.unsupported(body)
    if field is not None:
        raise api.bad(f"{field}: not supported yet by jaxpd", field, "unsupported_parameter")
    chat = isinstance(body, api.ChatBody)
    rename = {"prompt_token_ids": "messages" if chat else "prompt",
              "prompt": "messages" if chat else "prompt"}
    if chat and body.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    try:
        ids = _prompt_ids(svc, body)
        params = api.sampling_params(body, len(ids), svc.frontend.config.max_model_len)
        return svc.start(ids, params)
    except ValueError as e:
        raise api.value_error(e, _SAMPLING_FIELDS, rename) from None


def _aborted(r: Request) -> api.ApiError:
    reason = r.abort_reason or "aborted"
    if reason == "shutdown" or reason.startswith("failed"):
        return api.unavailable(f"the request was aborted: {reason}")
    return api.ApiError(500, f"the request was aborted: {reason}", type="internal_error",
                        code="aborted")


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise api.ApiError(413, f"the request body has {declared} bytes, more than {limit}",
                           code="request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise api.ApiError(413, f"the request body is over {limit} bytes",
                               code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(svc: OpenAIService, render_metrics: Callable[[], str] | None = None,
              openai_routes: bool = True) -> FastAPI:
    """The FastAPI app of `svc`. `render_metrics`: the /metrics text (default: `svc`'s
    histograms and stats through the shared Prometheus collector). `openai_routes`
    False: /health and /metrics only (a prefill or decode worker, which serves no
    client directly)."""
    app = FastAPI(title="jaxpd", docs_url=None, redoc_url=None, openapi_url=None)
    render = render_metrics or (lambda: svc.metrics.render(svc.stats()))

    @app.exception_handler(api.ApiError)
    async def api_error(_, e: api.ApiError):
        return e.response()

    @app.get("/health")
    async def health():
        code, body = await run_in_threadpool(svc.health)
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await run_in_threadpool(render), media_type=CONTENT_TYPE)

    if not openai_routes:
        return app

    @app.get("/v1/models")
    async def models():
        fe = svc.require_frontend()
        return {"object": "list", "data": [{
            "id": svc.model_id, "object": "model", "created": 0, "owned_by": "jaxpd",
            "root": fe.model_path, "max_model_len": fe.config.max_model_len}]}

    async def generation(http: HttpRequest, kind: type[api.CompletionBody] | type[api.ChatBody]):
        svc.require_frontend()
        raw = await _read_body(http, svc.max_body_bytes)
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise api.bad(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise api.bad("the request body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            raise api.validation_error(e) from None
        r = await run_in_threadpool(_prepare, svc, body)
        chat = kind is api.ChatBody
        if body.stream:
            return StreamingResponse(_stream(svc, r, body, http, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in svc.events(r, http):
                pass
        finally:
            svc.finish(r)
        if r.finish_reason not in ("stop", "length"):
            raise _aborted(r)
        text = svc.frontend.tokenizer.decode(r.output_ids) if svc.frontend.tokenizer else ""
        return api.whole_response(r, text, body, svc.model_id)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generation(http, api.CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generation(http, api.ChatBody)

    return app


async def _stream(svc: OpenAIService, r: Request, body: api.Body, http: HttpRequest,
                  chat: bool) -> AsyncIterator[bytes]:
    """The SSE chunks of one request; closing it (the client left) aborts the request."""
    fe = svc.frontend
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + r.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": svc.model_id}
    usage = body.stream_options is not None and body.stream_options.include_usage
    decoder = IncrementalDecoder(fe.tokenizer) if fe.tokenizer else None

    def chunk(text: str | None, ids: list[int], finish: str | None, first: bool = False):
        if chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = ids
        return api.sse({**head, "choices": [choice], **({"usage": None} if usage else {})})

    try:
        if chat:
            yield chunk("", [], None, first=True)
        async for ids, finish in svc.events(r, http):
            text = decoder.push(ids) if decoder else ""
            if finish is None:
                if text or body.return_token_ids:
                    yield chunk(text, ids, None)
                continue
            if finish == "abort":
                yield api.sse(_aborted(r).body())
                break
            text += decoder.flush() if decoder else ""
            if text or ids:
                yield chunk(text, ids, None)
            yield chunk(None, [], finish)
            if usage:
                yield api.sse({**head, "choices": [], "usage": api.usage(r)})
        yield b"data: [DONE]\n\n"
    finally:
        svc.finish(r, "client disconnected")


# ---- the server ---------------------------------------------------------------------

class HttpServer:
    """uvicorn serving `build_app(service)` on one named thread (`jaxpd-http`), bound at
    construction (`port` 0: a free port, read `.port`). Answers 503 until `attach`.
    `ssl`: uvicorn's TLS options (`ssl_certfile`, `ssl_keyfile`, ...) to serve HTTPS.
    `openai_routes`: see `build_app`."""

    def __init__(self, service: OpenAIService, host: str = "127.0.0.1", port: int = 0,
                 render_metrics: Callable[[], str] | None = None, ssl: dict | None = None,
                 openai_routes: bool = True):
        self.service = service
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port} (HTTP): {e}") from None
        self._sock = sock
        self.host, self.port = host, sock.getsockname()[1]
        config = uvicorn.Config(build_app(service, render_metrics, openai_routes),
                                log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=_FINAL_MESSAGE_S,
                                limit_concurrency=2 * service.max_concurrent + 64,
                                **(ssl or {}))
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="jaxpd-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise OSError(f"the HTTP server on {host}:{self.port} did not start")
            time.sleep(0.01)
        self._stopped = False

    def attach(self, frontend: Frontend) -> None:
        self.service.attach(frontend)

    def set_serving(self, serving: bool) -> None:
        self.service.serving = serving

    def stop(self, grace_s: float = 5.0) -> None:
        """/health says draining and new requests get 503; in-flight ones get `grace_s`
        to finish, then abort with reason 'shutdown' (a stream ends with an error
        event); uvicorn stops and its thread is joined. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        svc = self.service
        svc.draining = True
        if svc.frontend is not None and not svc.wait_done(grace_s):
            svc.abort_all("shutdown")
            svc.wait_done(_FINAL_MESSAGE_S)
        self._uvicorn.should_exit = True
        self._thread.join(_FINAL_MESSAGE_S + 5)
        self._sock.close()
