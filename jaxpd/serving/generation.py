"""The gRPC `jaxpd.v1.Generation` service over a front end (`LLM` or `Router`).

`GenerationServicer` turns RPCs into requests of a front end -- an `LLM` (engine in
this process) or anything with its interface (`make_request`, `submit`, `abort`,
`events`, `completion`, `stats`, `tokenizer`, `config`, `model_config`, `model_path`):
- bad input is INVALID_ARGUMENT with a message naming the field (the `ValueError`s of
  `SamplingParams` and `jaxpd.validation`, plus the proto-level checks here), bytes that
  do not parse as the request message included (the service's handlers parse requests
  themselves: grpc's own deserializer would answer INTERNAL);
- work is bounded before it starts: prompt and Tokenize text over `max_prompt_bytes`
  are refused before the tokenizer sees them (which then runs without holding the GIL),
  token ids over `max_prompt_len` and stop ids over `MAX_STOP_TOKEN_IDS` before they are
  copied;
- overload is RESOURCE_EXHAUSTED before any work is done: more than
  `max_concurrent_rpcs` Generate/Complete calls at once, the engine's bounded queue
  (`QueueFull`), or the predicted TTFT above the SLO (`jaxpd.admission`);
- a cancelled call or a passed deadline aborts the request at once (the handler is
  cancelled, and an RPC done-callback), so its slot and pages are freed by the engine's
  next iteration.

The handlers are coroutines on the server's `grpc.aio` event loop: a request's events
reach it through an `AsyncOutputs` (the engine's thread hands them over without
blocking), so a call in flight costs no thread. What blocks runs on small pools:
tokenizing and submitting on `prep_pool`, Stats (a router asks every worker) on
`control_pool`. A stream whose client reads slower than tokens come is cut off past
`max_buffered` unread events (`SLOW_READER`).

Request ids: the front end always runs a request under an id it assigns itself
(`req-` + 64 random bits in an engine). A client-chosen `request_id` is validated
(`check_request_id`: at most 128 characters of `[A-Za-z0-9._:@/+=-]`), echoed in every
response and used for nothing else: two callers choosing the same id never collide (no
ALREADY_EXISTS), and no public RPC looks a request up by id, so no caller can reach
another's request. Unset, the response carries the assigned id.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent import futures
from typing import TYPE_CHECKING, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from jaxpd.serving.admission import AdmissionController
from jaxpd.outputs import RequestMetrics, StreamDelta
from jaxpd.errors import QueueFull
from jaxpd.output_sink import MAX_BUFFERED, AsyncOutputs
from jaxpd.serving.prometheus import ServingMetrics
from jaxpd.serving.proto import jaxpd_pb2
from jaxpd.request import Request, State
from jaxpd.serving.messages import logprobs_message, metrics_message, sampling_params
from jaxpd.validation import check_request_id, check_text_size, default_max_prompt_bytes

if TYPE_CHECKING:
    from jaxpd.llm import LLM

_SERVICE = jaxpd_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE_NAME = _SERVICE.full_name
# A call cancelled with less than this left before its deadline ended by the deadline.
DEADLINE_SLACK_S = 0.5


class _Reject(Exception):
    """Answer the RPC with this status and message (raised inside the servicer)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _parse(data: bytes, request_class):
    try:
        return request_class.FromString(data), None
    except DecodeError as e:
        return None, f"the request is not a valid {request_class.DESCRIPTOR.full_name}: {e}"


def _parsing(behaviour: Callable, request_class, streaming: bool) -> Callable:
    """`behaviour` taking the request's bytes: what does not parse is INVALID_ARGUMENT."""
    if streaming:
        async def handle_stream(data: bytes, context):
            request, error = _parse(data, request_class)
            if error is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            async for reply in behaviour(request, context):
                yield reply
        return handle_stream

    async def handle(data: bytes, context):
        request, error = _parse(data, request_class)
        if error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return await behaviour(request, context)
    return handle


class GenerationServicer:
    """RPCs -> front-end requests. Answers UNAVAILABLE until `attach` and after `drain`.

    `max_generating`: Generate/Complete calls at once (more: RESOURCE_EXHAUSTED).
    `max_prompt_bytes`: longest prompt/Tokenize text; None: derived from the front
    end's max_prompt_len (`default_max_prompt_bytes`). `max_buffered`: events of one
    request the client has not read yet; past it the request aborts (`SLOW_READER`)."""

    def __init__(self, admission: AdmissionController, metrics: ServingMetrics,
                 max_generating: int = 4096, max_prompt_bytes: int | None = None,
                 max_buffered: int = MAX_BUFFERED):
        if max_generating < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_generating}")
        if max_prompt_bytes is not None and max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be >= 1, got {max_prompt_bytes}")
        self.admission, self.metrics = admission, metrics
        self.max_generating, self._max_prompt_bytes = max_generating, max_prompt_bytes
        self.max_buffered = max_buffered
        self.llm: LLM | None = None
        self._lock = threading.Lock()
        self._generation_done = threading.Condition(self._lock)
        # engine request_id -> (request, prompt tokens queued ahead of it when it arrived)
        self._in_flight: dict[str, tuple[Request, int]] = {}
        self._num_generating = 0   # calls holding a slot (their handler runs)
        # Calls not yet ended in grpc: a handler returns before grpc sends the status
        # (the stream's last message may still be on its way), and a `stop` that then
        # cancels all calls turns the client's end into an error.
        self._num_open_calls = 0
        self._draining = False
        self.num_queue_full = 0
        self.num_rpc_limit = 0

    def attach(self, llm: LLM) -> None:
        self.llm = llm

    def drain(self) -> None:
        """Refuse new requests; abort reasons of those cut off from now on are 'shutdown'."""
        self._draining = True

    def abort_all(self, reason: str) -> None:
        with self._lock:
            live = [r for r, _ in self._in_flight.values()]
        for r in live:
            self.llm.abort(r.request_id, reason)

    def wait_generation_done(self, timeout_s: float) -> bool:
        """Wait until every Generate/Complete call has ended in grpc (its status sent, or
        it was cancelled); False if `timeout_s` passed."""
        with self._generation_done:
            return self._generation_done.wait_for(lambda: self._num_open_calls == 0,
                                                  timeout=timeout_s)

    @property
    def max_prompt_bytes(self) -> int:
        if self._max_prompt_bytes is not None:
            return self._max_prompt_bytes
        return default_max_prompt_bytes(self.llm.config.max_prompt_len)

    def handlers(self, prep_pool: futures.Executor, control_pool: futures.Executor
                 ) -> grpc.GenericRpcHandler:
        """The Generation service for a `grpc.aio` server, every method as the proto
        declares it, parsing its requests itself; tokenizing and submitting run on
        `prep_pool`, Stats on `control_pool`."""
        self._prep_pool, self._control_pool = prep_pool, control_pool
        methods = {}
        for method in _SERVICE.methods:
            request_class = getattr(jaxpd_pb2, method.input_type.name)
            response_class = getattr(jaxpd_pb2, method.output_type.name)
            behaviour = _parsing(getattr(self, method.name), request_class,
                                 method.server_streaming)
            make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                    else grpc.unary_unary_rpc_method_handler)
            methods[method.name] = make(behaviour, request_deserializer=None,
                                        response_serializer=response_class.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)

    @staticmethod
    async def _on(pool: futures.Executor, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # ---- RPCs ---------------------------------------------------------------------

    async def Generate(self, request, context):
        async with self._generation_slot(context):
            requests, label, outputs = await self._start(request, context)
            try:
                async for i, d in self._deltas(requests, outputs):
                    reply = jaxpd_pb2.GenerateResponse(
                        request_id=label or requests[i].request_id, token_ids=d.token_ids,
                        text=d.text, index=i, logprobs=logprobs_message(d.logprobs))
                    if d.finish_reason is not None:
                        reply.finish_reason = d.finish_reason
                        reply.metrics.CopyFrom(metrics_message(requests[i]))
                    yield reply
            finally:
                for r in requests:
                    self._finish(r, self._end_reason(context))

    async def Complete(self, request, context):
        async with self._generation_slot(context):
            requests, label, outputs = await self._start(request, context)
            try:
                async for _ in self._deltas(requests, outputs):
                    pass
                samples = []
                for i, r in enumerate(requests):
                    out = self.llm.completion(r, i)
                    samples.append(jaxpd_pb2.Sample(
                        index=i, request_id=label or r.request_id, token_ids=out.token_ids,
                        text=out.text or "", finish_reason=out.finish_reason,
                        metrics=metrics_message(r), logprobs=logprobs_message(out.logprobs)))
                first = samples[0]
                return jaxpd_pb2.CompleteResponse(
                    request_id=first.request_id, prompt_token_ids=requests[0].prompt_ids,
                    token_ids=first.token_ids, text=first.text,
                    finish_reason=first.finish_reason, metrics=first.metrics,
                    logprobs=first.logprobs, samples=samples)
            finally:
                for r in requests:
                    self._finish(r, self._end_reason(context))

    async def Tokenize(self, request, context):
        llm = await self._llm(context)
        if llm.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this model has no tokenizer.json; send token_ids instead")
        try:
            check_text_size(request.text, self.max_prompt_bytes, "text")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = await self._on(self._prep_pool, llm.tokenizer.encode, request.text)
        return jaxpd_pb2.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request, context):
        llm = await self._llm(context)
        cfg = llm.config
        return jaxpd_pb2.ModelInfoResponse(
            model_path=llm.model_path, vocab_size=llm.model_config.vocab_size,
            max_prompt_len=cfg.max_prompt_len, max_model_len=cfg.max_model_len,
            mesh=str(cfg.mesh), eos_token_ids=llm.model_config.eos_token_ids,
            has_tokenizer=llm.tokenizer is not None, dtype=cfg.dtype, page_size=cfg.page_size,
            fingerprint=(llm.fingerprint or "")[:12])

    async def Stats(self, request, context):
        await self._llm(context)
        fields = jaxpd_pb2.StatsResponse.DESCRIPTOR.fields_by_name
        stats = await self._on(self._control_pool, self.stats)
        return jaxpd_pb2.StatsResponse(**{k: v for k, v in stats.items()
                                          if k in fields and v is not None})

    def stats(self) -> dict:
        """The engine's stats plus the server's own counts (one dict for Stats and /metrics)."""
        stats = dict(self.llm.stats()) if self.llm is not None else {}
        with self._lock:
            stats["requests_in_flight"] = len(self._in_flight)
            stats["rejections_queue_full"] = self.num_queue_full
            stats["rejections_rpc_limit"] = self.num_rpc_limit
        stats["rejections_slo"] = self.admission.num_rejected
        stats["rejections"] = (stats["rejections_queue_full"] + stats["rejections_rpc_limit"]
                               + stats["rejections_slo"])
        stats["prefill_s_per_token"] = self.admission.s_per_token
        return stats

    # ---- helpers ------------------------------------------------------------------

    async def _llm(self, context) -> LLM:
        if self.llm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.llm

    @contextlib.asynccontextmanager
    async def _generation_slot(self, context):
        """Hold one of `max_generating` slots while the handler runs, or refuse it; the
        call stays open (`wait_generation_done`) until grpc has ended it."""
        with self._lock:
            full = self._num_generating >= self.max_generating
            if full:
                self.num_rpc_limit += 1
            else:
                self._num_generating += 1
        if full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_generating} Generate/Complete calls are in flight "
                                f"(max_concurrent_rpcs={self.max_generating})")
        with self._lock:
            self._num_open_calls += 1
        context.add_done_callback(lambda _: self._call_ended())
        try:
            yield
        finally:
            with self._lock:
                self._num_generating -= 1

    def _call_ended(self) -> None:
        """grpc's callback when a call ends: after its status went out, or a cancel."""
        with self._generation_done:
            self._num_open_calls -= 1
            self._generation_done.notify_all()

    def _end_reason(self, context) -> str:
        """Why a call's requests are aborted when it ends before they do. A client ends
        its call at its own deadline, which is earlier than ours by the time its request
        took to reach us: a cancel that close to our deadline is the deadline."""
        if self._draining:
            return "shutdown"
        left = context.time_remaining()
        if left is not None and left <= DEADLINE_SLACK_S:
            return "deadline exceeded"
        return "cancelled"

    async def _deltas(self, requests: list[Request], outputs: AsyncOutputs
                      ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(index, delta) of `requests` as their events reach `outputs`."""
        makers = [self.llm.delta_maker(r) for r in requests]
        live = len(requests)
        while live:
            i, (ids, finish) = await outputs.get()
            yield i, makers[i](ids, finish)
            live -= finish is not None

    def _make_requests(self, msg: jaxpd_pb2.GenerateRequest) -> tuple[list[Request], str | None]:
        """Validate and build (one request per sample) under ids the front end assigns;
        also returns the client's own id (validated) to echo. ValueError names the field."""
        llm = self.llm
        params = sampling_params(msg)
        which = msg.WhichOneof("input")
        if which is None:
            raise ValueError("give one of prompt (text) and token_ids")
        client_id = None
        if msg.HasField("request_id"):
            if not msg.request_id:
                raise ValueError("request_id is empty (leave it unset to get one assigned)")
            client_id = check_request_id(msg.request_id)
        if which == "token_ids":
            if not msg.token_ids.ids:
                raise ValueError("token_ids is empty")
            if len(msg.token_ids.ids) > llm.config.max_prompt_len:
                raise ValueError(f"prompt has {len(msg.token_ids.ids)} tokens, more than "
                                 f"max_prompt_len={llm.config.max_prompt_len}")
            ids = list(msg.token_ids.ids)
        else:
            if not msg.prompt:
                raise ValueError("prompt is empty")
            if llm.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer.json; send token_ids instead")
            check_text_size(msg.prompt, self.max_prompt_bytes, "prompt")
            ids = llm.tokenizer.encode(msg.prompt)
            if not ids:
                raise ValueError("prompt encodes to no tokens")
        return llm.make_requests(prompt_token_ids=ids, sampling_params=params), client_id

    async def _start(self, msg: jaxpd_pb2.GenerateRequest, context
                     ) -> tuple[list[Request], str | None, AsyncOutputs]:
        """Validate, admit, submit (every sample, or none), and arrange for the call's
        end to abort them; a refusal aborts the call. Returns the requests, the
        client's id to echo (if it gave one) and where their events go."""
        llm = await self._llm(context)
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        loop = asyncio.get_running_loop()
        try:
            requests, client_id, outputs = await self._on(self._prep_pool, self._submit_all,
                                                          llm, msg, loop)
        except _Reject as e:
            await context.abort(e.code, e.message)
        # At once on a cancel or a passed deadline (the handler may be waiting for the
        # next token); a no-op after a normal end.
        context.add_done_callback(
            lambda _: [self._finish(r, self._end_reason(context)) for r in requests])
        return requests, client_id, outputs

    def _submit_all(self, llm: LLM, msg: jaxpd_pb2.GenerateRequest,
                    loop: asyncio.AbstractEventLoop
                    ) -> tuple[list[Request], str | None, AsyncOutputs]:
        """Blocking (tokenizer, front end): build and submit every sample or none,
        their events going to one `AsyncOutputs` on `loop`. Raises _Reject."""
        try:
            requests, client_id = self._make_requests(msg)
        except ValueError as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        outputs = AsyncOutputs(loop, len(requests), self.max_buffered)
        for r, sink in zip(requests, outputs.sinks):
            r.events = sink
        submitted = []
        try:
            for r in requests:
                self._submit_one(llm, r)
                submitted.append(r)
        except _Reject:
            for r in submitted:
                self._finish(r, "a sibling sample was refused")
            raise
        return requests, client_id, outputs

    def _submit_one(self, llm: LLM, r: Request) -> None:
        with self._lock:
            ahead = sum(q.num_tokens for q, _ in self._in_flight.values()
                        if q.state in (State.WAITING, State.PREFILLING))
        refusal = self.admission.check(ahead, len(r.prompt_ids))
        if refusal is not None:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        with self._lock:
            self._in_flight[r.request_id] = (r, ahead)
        try:
            llm.submit(r)
        except QueueFull as e:
            self._forget(r)
            with self._lock:
                self.num_queue_full += 1
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except RuntimeError as e:   # engine failed or shut down
            self._forget(r)
            raise _Reject(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except ValueError as e:     # e.g. stop strings on a model without a tokenizer
            self._forget(r)
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if self._draining:   # `stop` began while it was submitted: abort_all may have missed it
            llm.abort(r.request_id, "shutdown")

    def _finish(self, r: Request, reason: str = "cancelled") -> None:
        """The RPC is done with `r`: abort it if it still runs, and the first time,
        forget it and learn from it if it finished. Both the handler and the RPC
        callback call this; whichever runs second finds nothing to do."""
        if not r.is_final:
            self.llm.abort(r.request_id, "shutdown" if self._draining else reason)
        with self._lock:
            entry = self._in_flight.pop(r.request_id, None)
        if entry is not None and r.finish_reason in ("stop", "length"):
            m = RequestMetrics.of(r)
            self.metrics.observe(m)
            self.admission.observe(entry[1], len(r.prompt_ids), m)

    def _forget(self, r: Request) -> None:
        with self._lock:
            self._in_flight.pop(r.request_id, None)
