"""The gRPC server of the public `jaxpd.v1.Generation` service and its lifecycle.

`InferenceServer` owns a `grpc.aio` server, standard health checking (`grpc.health.v1`:
NOT_SERVING until `attach(llm)` -- model loaded and warm -- SERVING then, NOT_SERVING
from `stop()` on), server reflection, and the optional Prometheus endpoint. It does not
own the front end: whoever built it shuts it down. Its threads, whatever the number of
calls in flight:
- `jaxpd-grpc`: the event loop every call runs on (`GenerationServicer`'s coroutines,
  health Check and Watch, reflection);
- `jaxpd-grpc-prep-*`: tokenizing and submitting (`_PREP_THREADS`);
- `jaxpd-grpc-control-*`: Stats (`_CONTROL_THREADS`), so a slow back end's stats never
  hold up a submit;
the pools start threads as work needs them and a thread idle for `rpc_idle_s` exits
(`ShrinkingThreadPool`). grpc's own `maximum_concurrent_rpcs` is only a backstop
against floods (`max_concurrent_rpcs` + `_BACKLOG` running or queued calls):
generation holds at most `max_concurrent_rpcs` of them.
"""
from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from jaxpd.serving.admission import AdmissionController
from jaxpd.serving.pool import ShrinkingThreadPool
from jaxpd.serving.prometheus import MetricsEndpoint, ServingCollector, ServingMetrics
from jaxpd.serving.generation import SERVICE_NAME, GenerationServicer

if TYPE_CHECKING:
    from jaxpd.llm import LLM

_PREP_THREADS = 4        # tokenizing, submitting
_CONTROL_THREADS = 4     # Stats
_BACKLOG = 64            # grpc's backstop: calls beyond the generation cap
_FINAL_MESSAGE_S = 5.0   # at stop, for aborted streams to send their last message and
#                          status (a bound, not a wait: on a loaded machine 2 s once fell short)
_GRPC_MAX_MESSAGE = 4 * 1024 * 1024   # grpc's default receive limit


class InferenceServer:
    """gRPC server + health + reflection (+ /metrics), up from construction on.

    `port` 0 binds a free port (read `.port`); `metrics_port` None: no /metrics,
    0: a free one (read `.metrics_port`). `max_concurrent_rpcs`: Generate/Complete calls
    at once. `max_prompt_bytes`: longest prompt or Tokenize text (None: from the front
    end's max_prompt_len). `rpc_idle_s`: an RPC thread idle this long exits. `tls`:
    serve TLS with these credentials (`grpc.ssl_server_credentials`; clients may also
    be asked for certificates) instead of plaintext. Serving starts with `attach(llm)`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, slo_ttft_ms: float = 0.0,
                 metrics_port: int | None = None, max_concurrent_rpcs: int = 4096,
                 max_prompt_bytes: int | None = None, rpc_idle_s: float = 30.0,
                 tls: grpc.ServerCredentials | None = None):
        self.metrics = ServingMetrics()
        self.servicer = GenerationServicer(AdmissionController(slo_ttft_ms / 1000), self.metrics,
                                           max_concurrent_rpcs, max_prompt_bytes)
        self._prep_pool = ShrinkingThreadPool(_PREP_THREADS, "jaxpd-grpc-prep", rpc_idle_s)
        self._control_pool = ShrinkingThreadPool(_CONTROL_THREADS, "jaxpd-grpc-control",
                                                 rpc_idle_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxpd-grpc",
                                        daemon=True)
        self._thread.start()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        max_message = max(_GRPC_MAX_MESSAGE, (max_prompt_bytes or 0) + 64 * 1024)
        try:
            self.port = self._on_loop(self._start(address, tls, max_concurrent_rpcs,
                                                  max_message))
        except BaseException:
            self._close_loop()
            raise
        self.host = host
        self._metrics_endpoint = None
        if metrics_port is not None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(ServingCollector(self.metrics, self.servicer.stats))
            try:
                self._metrics_endpoint = MetricsEndpoint(registry, host, metrics_port)
            except OSError:
                self._on_loop(self._grpc.stop(0))
                self._close_loop()
                raise
        self.metrics_port = None if self._metrics_endpoint is None else self._metrics_endpoint.port
        self._stopped = False

    def _on_loop(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, address: str, tls: grpc.ServerCredentials | None,
                     max_concurrent_rpcs: int, max_message: int) -> int:
        self.health = health.aio.HealthServicer()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._grpc = grpc.aio.server(maximum_concurrent_rpcs=max_concurrent_rpcs + _BACKLOG,
                                     options=[("grpc.max_receive_message_length", max_message)])
        self._grpc.add_generic_rpc_handlers((self.servicer.handlers(self._prep_pool,
                                                                    self._control_pool),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        try:
            port = (self._grpc.add_secure_port(address, tls) if tls is not None
                    else self._grpc.add_insecure_port(address))
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        await self._grpc.start()
        return port

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._prep_pool.shutdown(wait=True)
        self._control_pool.shutdown(wait=True)

    def attach(self, llm: LLM) -> None:
        """Serve `llm` (loaded and warm): health flips to SERVING."""
        self.servicer.attach(llm)
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING (a router whose last decode worker left); a
        no-op once stopped (health says NOT_SERVING for good)."""
        if self._stopped:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)

        async def set_all():
            for service in ("", SERVICE_NAME):
                await self.health.set(service, status)
        self._on_loop(set_all())

    def render_metrics(self) -> str:
        return self.metrics.render(self.servicer.stats())

    def stop(self, grace_s: float = 5.0) -> None:
        """Health NOT_SERVING and new calls refused (UNAVAILABLE); in-flight ones get
        `grace_s` to finish; then their requests abort with reason 'shutdown' and each
        stream still sends its final message (finish_reason 'abort', metrics.abort_reason
        'shutdown') before the grpc server closes; the threads are joined. Idempotent;
        the front end keeps running."""
        if self._stopped:
            return
        self._stopped = True
        self.servicer.drain()          # first: once health says so, calls are refused
        self._on_loop(self.health.enter_graceful_shutdown())
        if self.servicer.llm is not None and not self.servicer.wait_generation_done(grace_s):
            self.servicer.abort_all("shutdown")
            self.servicer.wait_generation_done(_FINAL_MESSAGE_S)
        self._on_loop(self._grpc.stop(0))
        self._close_loop()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
