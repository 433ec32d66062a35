"""The gRPC `jaxpd.v1.Generation` service over an `LLM`, and the server's lifecycle.

`GenerationServicer` turns RPCs into requests of a front end -- an `LLM` (engine in
this process) or anything with its interface (`make_request`, `submit`, `abort`,
`events`, `completion`, `stats`, `tokenizer`, `config`, `model_config`, `model_path`):
- bad input is INVALID_ARGUMENT with a message naming the field (the `ValueError`s of
  `SamplingParams` and `LLM.make_request`, plus the proto-level checks here);
- overload is RESOURCE_EXHAUSTED before any work is done: the engine's bounded queue
  (`QueueFull`) or the predicted TTFT above the SLO (`jaxpd.admission`);
- a cancelled call or a passed deadline aborts the request at once (an RPC callback),
  so its slot and pages are freed by the engine's next iteration.

`InferenceServer` owns the grpc server (a thread pool named `jaxpd-grpc-*`), standard
health checking (`grpc.health.v1`: NOT_SERVING until `attach(llm)` -- model loaded and
warm -- SERVING then, NOT_SERVING from `stop()` on), server reflection, and the
optional Prometheus endpoint. It does not own the front end: whoever built it shuts it down.
"""
from __future__ import annotations

import threading
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxpd.serving.admission import AdmissionController
from jaxpd.errors import QueueFull
from jaxpd.outputs import RequestMetrics
from jaxpd.serving.prometheus import MetricsEndpoint, ServingMetrics
from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.models.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from jaxpd.llm import LLM

SERVICE_NAME = jaxpd_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_DEFAULTS = SamplingParams()
_INT32_MAX = 2**31 - 1   # the engine keeps top_k in an int32 array


class _Reject(Exception):
    """Answer the RPC with this status and message (raised inside the servicer)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def sampling_params(msg: jaxpd_pb2.GenerateRequest) -> SamplingParams:
    """The request's sampling options; unset optional fields take SamplingParams' defaults.
    Raises ValueError naming the field."""
    if not 0 <= msg.top_k <= _INT32_MAX:
        raise ValueError(f"top_k must be an integer in [0, 2**31) (0 = off), got {msg.top_k}")
    opt = lambda name: getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)
    return SamplingParams(max_tokens=opt("max_tokens"), temperature=opt("temperature"),
                          top_k=msg.top_k, top_p=opt("top_p"), seed=opt("seed"),
                          stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos)


def metrics_message(r: Request) -> jaxpd_pb2.RequestMetrics:
    m = RequestMetrics.of(r)
    return jaxpd_pb2.RequestMetrics(
        ttft_s=m.ttft_s, tpot_s=m.tpot_s, queue_s=m.queue_s, prefill_s=m.prefill_s,
        transfer_s=m.transfer_s, transfer_bytes=m.transfer_bytes, e2e_s=m.e2e_s,
        num_preemptions=m.num_preemptions, abort_reason=r.abort_reason)


class GenerationServicer(jaxpd_pb2_grpc.GenerationServicer):
    """RPCs -> `LLM` requests. Answers UNAVAILABLE until `attach` and after `drain`."""

    def __init__(self, admission: AdmissionController, metrics: ServingMetrics):
        self.admission, self.metrics = admission, metrics
        self.llm: LLM | None = None
        self._lock = threading.Lock()
        # request_id -> (request, prompt tokens queued ahead of it when it arrived)
        self._in_flight: dict[str, tuple[Request, int]] = {}
        self._draining = False
        self.num_queue_full = 0

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

    # ---- RPCs ---------------------------------------------------------------------

    def Generate(self, request, context):
        try:
            r = self._start(request, context)
        except _Reject as e:
            context.abort(e.code, e.message)
        decoder = IncrementalDecoder(self.llm.tokenizer) if self.llm.tokenizer else None
        try:
            for ids, finish in self.llm.events(r):
                text = decoder.push(ids) if decoder else ""
                if finish is None:
                    yield jaxpd_pb2.GenerateResponse(request_id=r.request_id, token_ids=ids,
                                                     text=text)
                else:
                    text += decoder.flush() if decoder else ""
                    yield jaxpd_pb2.GenerateResponse(request_id=r.request_id, token_ids=ids,
                                                     text=text, finish_reason=finish,
                                                     metrics=metrics_message(r))
        finally:
            self._finish(r)

    def Complete(self, request, context):
        try:
            r = self._start(request, context)
        except _Reject as e:
            context.abort(e.code, e.message)
        try:
            for _ in self.llm.events(r):
                pass
            out = self.llm.completion(r)
            return jaxpd_pb2.CompleteResponse(
                request_id=r.request_id, prompt_token_ids=out.prompt_token_ids,
                token_ids=out.token_ids, text=out.text or "", finish_reason=out.finish_reason,
                metrics=metrics_message(r))
        finally:
            self._finish(r)

    def Tokenize(self, request, context):
        llm = self._llm(context)
        if llm.tokenizer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this model has no tokenizer.json; send token_ids instead")
        return jaxpd_pb2.TokenizeResponse(token_ids=llm.tokenizer.encode(request.text))

    def ModelInfo(self, request, context):
        llm = self._llm(context)
        cfg = llm.config
        return jaxpd_pb2.ModelInfoResponse(
            model_path=llm.model_path, vocab_size=llm.model_config.vocab_size,
            max_prompt_len=cfg.max_prompt_len, max_model_len=cfg.max_model_len,
            mesh=str(cfg.mesh), eos_token_ids=llm.model_config.eos_token_ids,
            has_tokenizer=llm.tokenizer is not None, dtype=cfg.dtype, page_size=cfg.page_size)

    def Stats(self, request, context):
        self._llm(context)
        fields = jaxpd_pb2.StatsResponse.DESCRIPTOR.fields_by_name
        return jaxpd_pb2.StatsResponse(**{k: v for k, v in self.stats().items()
                                          if k in fields and v is not None})

    def stats(self) -> dict:
        """The engine's stats plus the server's own counts (one dict for Stats and /metrics)."""
        stats = dict(self.llm.stats()) if self.llm is not None else {}
        with self._lock:
            stats["requests_in_flight"] = len(self._in_flight)
        stats["rejections_queue_full"] = self.num_queue_full
        stats["rejections_slo"] = self.admission.num_rejected
        stats["rejections"] = self.num_queue_full + self.admission.num_rejected
        stats["prefill_s_per_token"] = self.admission.s_per_token
        return stats

    # ---- helpers ------------------------------------------------------------------

    def _llm(self, context) -> LLM:
        if self.llm is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.llm

    def _make_request(self, msg: jaxpd_pb2.GenerateRequest) -> Request:
        """Validate and build; ValueError names the field."""
        llm = self.llm
        params = sampling_params(msg)
        which = msg.WhichOneof("input")
        if which is None:
            raise ValueError("give one of prompt (text) and token_ids")
        if msg.HasField("request_id") and not msg.request_id:
            raise ValueError("request_id is empty (leave it unset to get one assigned)")
        request_id = msg.request_id if msg.HasField("request_id") else None
        if which == "token_ids":
            ids = list(msg.token_ids.ids)
            if not ids:
                raise ValueError("token_ids is empty")
        else:
            if not msg.prompt:
                raise ValueError("prompt is empty")
            if llm.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer.json; send token_ids instead")
            ids = llm.tokenizer.encode(msg.prompt)
            if not ids:
                raise ValueError("prompt encodes to no tokens")
        return llm.make_request(prompt_token_ids=ids, sampling_params=params,
                                request_id=request_id)

    def _start(self, msg: jaxpd_pb2.GenerateRequest, context) -> Request:
        """Validate, admit, submit, and arrange for cancellation to abort it."""
        llm = self._llm(context)
        if self._draining:
            raise _Reject(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        try:
            r = self._make_request(msg)
        except ValueError as e:
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        with self._lock:
            ahead = sum(q.num_tokens for q, _ in self._in_flight.values()
                        if q.state in (State.WAITING, State.PREFILLING))
        refusal = self.admission.check(ahead, len(r.prompt_ids))
        if refusal is not None:
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        with self._lock:
            if r.request_id in self._in_flight:
                raise _Reject(grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id {r.request_id!r} is already in flight")
            self._in_flight[r.request_id] = (r, ahead)
        try:
            llm.submit(r)
        except QueueFull as e:
            self._forget(r)
            with self._lock:
                self.num_queue_full += 1
            raise _Reject(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except ValueError as e:   # a request_id the engine already knows
            self._forget(r)
            raise _Reject(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        except RuntimeError as e:   # engine failed or shut down
            self._forget(r)
            raise _Reject(grpc.StatusCode.UNAVAILABLE, str(e)) from None

        def on_rpc_done():
            # Runs when the RPC ends for any reason: at once on a cancel or a passed
            # deadline (the handler may still be blocked waiting for the next token),
            # and as a no-op after a normal end.
            if self._draining:
                reason = "shutdown"
            elif context.time_remaining() is not None and context.time_remaining() <= 0:
                reason = "deadline exceeded"
            else:
                reason = "cancelled"
            self._finish(r, reason)

        if not context.add_callback(on_rpc_done):
            on_rpc_done()   # the RPC already ended before we could register
        return r

    def _finish(self, r: Request, reason: str = "cancelled") -> None:
        """The RPC is done with `r`: abort it if it still runs, and the first time,
        forget it and learn from it if it finished. Both the handler and the RPC
        callback call this; whichever runs second finds nothing to do."""
        if not r.is_final:
            self.llm.abort(r.request_id, "shutdown" if self._draining else reason)
        with self._lock:
            entry = self._in_flight.get(r.request_id)
            if entry is None or entry[0] is not r:   # already done (or the id was reused)
                return
            del self._in_flight[r.request_id]
        if r.finish_reason in ("stop", "length"):
            m = RequestMetrics.of(r)
            self.metrics.observe(m)
            self.admission.observe(entry[1], len(r.prompt_ids), m)

    def _forget(self, r: Request) -> None:
        with self._lock:
            self._in_flight.pop(r.request_id, None)


class InferenceServer:
    """gRPC server + health + reflection (+ /metrics), up from construction on.

    `port` 0 binds a free port (read `.port`); `metrics_port` None: no /metrics,
    0: a free one (read `.metrics_port`). Serving starts with `attach(llm)`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, slo_ttft_ms: float = 0.0,
                 metrics_port: int | None = None, max_concurrent_rpcs: int = 128,
                 extra_handlers: tuple[grpc.GenericRpcHandler, ...] = ()):
        self.metrics = ServingMetrics()
        self.servicer = GenerationServicer(AdmissionController(slo_ttft_ms / 1000), self.metrics)
        self.health = health.HealthServicer()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        # One thread per streaming RPC; a few more than the RPC cap so that health
        # checks still get a thread when every stream is busy.
        self._executor = futures.ThreadPoolExecutor(max_workers=max_concurrent_rpcs + 4,
                                                    thread_name_prefix="jaxpd-grpc")
        self._grpc = grpc.server(self._executor, maximum_concurrent_rpcs=max_concurrent_rpcs)
        jaxpd_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self._grpc.add_generic_rpc_handlers(extra_handlers)   # e.g. the router's Register
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._grpc.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.host = host
        self._grpc.start()
        self._metrics_endpoint = (None if metrics_port is None else
                                  MetricsEndpoint(self.render_metrics, host, metrics_port))
        self.metrics_port = None if self._metrics_endpoint is None else self._metrics_endpoint.port
        self._stopped = False

    def attach(self, llm: LLM) -> None:
        """Serve `llm` (loaded and warm): health flips to SERVING."""
        self.servicer.attach(llm)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def render_metrics(self) -> str:
        return self.metrics.render(self.servicer.stats())

    def stop(self, grace_s: float = 5.0) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish for `grace_s`,
        then cut them off (their requests abort with reason 'shutdown'), join the threads.
        Idempotent; the `LLM` keeps running."""
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.servicer.drain()
        self._grpc.stop(grace_s).wait()
        if self.servicer.llm is not None:
            self.servicer.abort_all("shutdown")
        self._executor.shutdown(wait=True)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
