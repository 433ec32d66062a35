"""The OpenAI-compatible HTTP API over a front end (`LLM` or `Router`), with /health
and /metrics, served by uvicorn (FastAPI, the convention of vLLM and SGLang).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as Server-Sent
Events with `stream: true`, ending `data: [DONE]`; `stream_options.include_usage` adds
a last chunk with the usage, and with vLLM's `continuous_usage_stats` every chunk has
the usage so far), `GET /v1/models`, `GET /health`, `GET /metrics`.

Every field is mapped to what `SamplingParams` has (max_tokens / max_completion_tokens,
temperature, top_p, seed, stop, presence/frequency penalties, logprobs / top_logprobs,
n, and vLLM's top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos); a
completions request may carry a list of prompts (choices are prompt-major, `n` each).
A chat request may carry `tools` (rendered by the chat template, with
`chat_template_kwargs`), `tool_choice` `auto` or `none` and `parallel_tool_calls`; its
output is split by `jaxpd.parsing` into `reasoning_content`, `content` and `tool_calls`
(`finish_reason: "tool_calls"`), streamed as OpenAI streams them. `tool_choice`
`required` or a named function needs constrained decoding: a 400 until there is one.
Nothing is silently ignored: a field we do not know is a 400, and so is a known one
asking for what jaxpd cannot do (`logit_bias`, `echo`, `suffix`, `best_of` > n);
`user` alone is accepted and ignored (it only labels the caller). Errors have OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`: 400 bad field (`param` names
it), 404 unknown model, 413 a body over `max_body_bytes` (refused while it is read,
before any parsing), 429 with Retry-After when admission refuses (the engine's queue is
full, the predicted TTFT is over the SLO, or `max_concurrent` requests are running),
503 before `attach` (loading, compiling), while draining, or when the back end died.

Threads: uvicorn runs its event loop on one named thread (`jaxpd-http`); tokenizing,
submitting, /health and /metrics run on the service's few `jaxpd-http-prep` threads,
and every request's events reach the loop through an `AsyncOutputs`
(`jaxpd.serving.openai_service`): the thread count does not grow with the streams. A
client that goes away (the stream's generator is cancelled, or the disconnect message
arrives while a whole answer is awaited) aborts its requests at once, and the engine
frees their slots and pages; one that stops reading a stream is cut off past
`max_buffered` unread events (the request aborts: `SLOW_READER`).
"""
from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from jaxpd.output_sink import AsyncOutputs
from jaxpd.parsing import OutputDelta, OutputParser, output_parser, parse_output
from jaxpd.parsing.reasoning import reasoning_parser_for
from jaxpd.parsing.tool_calls import tool_parser_for
from jaxpd.request import Request
from jaxpd.serving import openai_api as api
from jaxpd.serving.openai_service import OpenAIService
from jaxpd.serving.prometheus import CONTENT_TYPE
from jaxpd.validation import check_text_size, default_max_prompt_bytes

if TYPE_CHECKING:
    from jaxpd.frontend import Frontend

__all__ = ["HttpServer", "OpenAIService", "build_app"]

_FINAL_MESSAGE_S = 2.0     # at stop, for aborted streams to send their last event
# uvicorn answers 503 past this many connections beyond the requests in flight: room for
# idle keep-alive connections and clients slow to send (one costs a socket, no thread).
_SPARE_CONNECTIONS = 16384
_START_TIMEOUT_S = 30.0


# ---- turning bodies into requests and responses -------------------------------------

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
                    "prompt", "prompt_token_ids", "token_ids", "messages", "request_id", "stop",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                    "logprobs", "n", "top_logprobs", "chat_template_kwargs",
                    "tool_call_parser")
MAX_PROMPTS = 64   # prompts in one completions request

MakeParser = Callable[[], OutputParser]


def _prompts(svc: OpenAIService, body: api.CompletionBody | api.ChatBody
             ) -> tuple[list[list[int]], MakeParser | None]:
    """Each prompt's token ids (given, tokenized, or the chat template's rendering), and
    for a chat whose output is split (reasoning, tool calls) a maker of each choice's
    output parser."""
    fe = svc.require_frontend()
    if isinstance(body, api.ChatBody):
        return _chat_prompt(svc, fe, body)
    prompt = body.prompt
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise api.bad(f"prompt: {len(prompts)} prompts, more than {MAX_PROMPTS}", "prompt")
    out = []
    for p in prompts:
        if isinstance(p, list):
            if not p:
                raise api.bad("prompt is empty", "prompt")
            if len(p) > fe.config.max_prompt_len:
                raise api.bad(f"prompt has {len(p)} tokens, more than "
                              f"max_prompt_len={fe.config.max_prompt_len}", "prompt")
            out.append(list(p))
        else:
            out.append(_encode(fe, p))
    return out, None


def _chat_prompt(svc: OpenAIService, fe: Frontend, body: api.ChatBody
                 ) -> tuple[list[list[int]], MakeParser | None]:
    tools, parse_tools = api.tool_options(body)
    messages = [api.flatten_content(m) for m in body.messages]
    text = fe.chat_prompt(messages, tools, body.chat_template_kwargs)
    template = fe.tokenizer.chat_template if fe.tokenizer is not None else None
    tool_parser = tool_parser_for(body.tool_call_parser or svc.tool_call_parser, template)
    reasoning_parser = reasoning_parser_for(svc.reasoning_parser, template)
    if not parse_tools and reasoning_parser == "none":
        return [_encode(fe, text)], None
    max_calls = 1 if body.parallel_tool_calls is False else None
    return [_encode(fe, text)], functools.partial(
        output_parser, template, text, tool_parser, reasoning_parser, parse_tools, max_calls)


def _encode(fe: Frontend, text) -> list[int]:
    if not isinstance(text, str):
        raise api.bad("prompt: a batch mixes texts and token lists", "prompt")
    if not text:
        raise api.bad("prompt is empty", "prompt")
    if fe.tokenizer is None:
        raise api.bad("prompt: this model has no tokenizer.json; send token ids", "prompt")
    check_text_size(text, default_max_prompt_bytes(fe.config.max_prompt_len), "prompt")
    ids = fe.tokenizer.encode(text)
    if not ids:
        raise api.bad("prompt encodes to no tokens", "prompt")
    return ids


def _prepare(svc: OpenAIService, body: api.CompletionBody | api.ChatBody,
             loop: asyncio.AbstractEventLoop
             ) -> tuple[list[Request], AsyncOutputs, MakeParser | None]:
    """Validate, tokenize, admit and submit (blocking): the requests in choice order,
    where their events go, and the maker of each choice's output parser (None: the
    text is the content)."""
    svc.require_frontend()
    svc.check_model(body.model)
    field = api.unsupported(body)
    if field is not None:
        raise api.bad(f"{field}: not supported by jaxpd", field, "unsupported_parameter")
    chat = isinstance(body, api.ChatBody)
    rename = {"prompt_token_ids": "messages" if chat else "prompt",
              "prompt": "messages" if chat else "prompt"}
    if chat and body.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    if chat and body.logprobs:
        rename["logprobs"] = "top_logprobs"
    try:
        prompts, make_parser = _prompts(svc, body)
        params = api.sampling_params(body, max(map(len, prompts)),
                                     svc.frontend.config.max_model_len)
        if len(prompts) * params.n > svc.max_concurrent:
            raise api.bad(f"n: {len(prompts)} prompts x n={params.n} samples is more than "
                          f"the {svc.max_concurrent} requests this server runs at once", "n")
        return (*svc.start(prompts, params, loop), make_parser)
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
        code, body = await svc.run(svc.health)
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await svc.run(render), media_type=CONTENT_TYPE)

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
        requests, outputs, make_parser = await svc.run(_prepare, svc, body,
                                                       asyncio.get_running_loop())
        if body.stream:
            return StreamingResponse(_stream(svc, requests, outputs, body, make_parser),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async with svc.watching(http, requests):
                async for _ in svc.deltas(requests, outputs):
                    pass
        finally:
            for r in requests:
                svc.finish(r)
        failed = next((r for r in requests if r.finish_reason not in ("stop", "length")), None)
        if failed is not None:
            raise _aborted(failed)
        fe = svc.frontend
        outputs = [fe.completion(r) for r in requests]
        parsers = ([parse_output(o.text or "", make_parser()) for o in outputs]
                   if make_parser else None)
        return api.whole_response(outputs, body, svc.model_id, fe.tokenizer, parsers)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await generation(http, api.CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await generation(http, api.ChatBody)

    return app


async def _stream(svc: OpenAIService, requests: list[Request], outputs: AsyncOutputs,
                  body: api.Body, make_parser: MakeParser | None = None
                  ) -> AsyncIterator[bytes]:
    """The SSE chunks of a request's samples (each chunk carries one choice, by index);
    closing it (the client left: Starlette cancels the response) aborts what still
    runs. With `make_parser`, each choice's text is split as it comes: reasoning and
    content deltas, then each tool call's deltas in chunks of their own."""
    chat = isinstance(body, api.ChatBody)
    tokenizer = svc.frontend.tokenizer
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + requests[0].request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": svc.model_id}
    options = body.stream_options
    usage = options is not None and options.include_usage
    continuous = usage and options.continuous_usage_stats
    offsets = [0] * len(requests)    # text already sent per choice (logprobs' text_offset)
    streamed = [0]                   # output tokens generated so far, every choice
    parsers = [make_parser() for _ in requests] if make_parser else None

    def chunk(i: int, text: str | None, finish: str | None, ids=(), logprobs=None,
              role: bool = False, parsed: OutputDelta | None = None) -> bytes:
        c = api.choice(i, text, finish, list(ids), logprobs, body, tokenizer,
                       offset=offsets[i], stream=True, role=role, parsed=parsed)
        offsets[i] += len(text or "")
        so_far = api.usage(requests, body, streamed[0]) if continuous else None
        return api.sse({**head, "choices": [c], **({"usage": so_far} if usage else {})})

    def parsed_chunks(i: int, d) -> Iterator[bytes]:
        parsed = parsers[i].feed(d.text)
        if d.finish_reason is not None:
            last = parsers[i].finish()
            parsed = OutputDelta(parsed.reasoning + last.reasoning,
                                 parsed.content + last.content,
                                 parsed.tool_calls + last.tool_calls)
        text_part = OutputDelta(parsed.reasoning, parsed.content)
        if text_part or d.token_ids and (body.return_token_ids or d.logprobs is not None):
            yield chunk(i, None, None, d.token_ids, d.logprobs, parsed=text_part)
        for call in parsed.tool_calls:
            yield chunk(i, None, None, parsed=OutputDelta(tool_calls=(call,)))
        if d.finish_reason is not None:
            yield chunk(i, None, "tool_calls" if parsers[i].calls else d.finish_reason)

    try:
        if chat:
            for i in range(len(requests)):
                yield chunk(i, "", None, role=True)
        async for i, d in svc.deltas(requests, outputs):
            streamed[0] += len(d.token_ids)
            if d.finish_reason == "abort":
                yield api.sse(_aborted(requests[i]).body())
                break
            if parsers is not None:
                for c in parsed_chunks(i, d):
                    yield c
                continue
            if d.text or d.token_ids and (body.return_token_ids or d.logprobs is not None):
                yield chunk(i, d.text, None, d.token_ids, d.logprobs)
            if d.finish_reason is not None:
                yield chunk(i, None, d.finish_reason)
        else:
            if usage:
                yield api.sse({**head, "choices": [], "usage": api.usage(requests, body)})
        yield b"data: [DONE]\n\n"
    finally:
        for r in requests:
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
                                limit_concurrency=service.max_concurrent + _SPARE_CONNECTIONS,
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
        svc.close()
