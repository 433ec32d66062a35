"""The gRPC server of the public `jaxpd.v1.Generation` service and its lifecycle.

`InferenceServer` owns the grpc server, standard health checking (`grpc.health.v1`:
NOT_SERVING until `attach(llm)` -- model loaded and warm -- SERVING then, NOT_SERVING
from `stop()` on), server reflection, and the optional Prometheus endpoint. It does not
own the front end: whoever built it shuts it down. Its threads:
- `jaxpd-grpc-*`: Generate, Complete (one thread for a call's whole life), Tokenize,
  and reflection; `max_concurrent_rpcs` + `_SPARE_THREADS`, so a call
  over the cap gets a thread to be refused on at once;
- `jaxpd-grpc-control-*`: ModelInfo and Stats, on `_CONTROL_THREADS` threads of their
  own, so they answer while every generation thread is busy;
- `jaxpd-grpc-health-*`: health Check alone, so not even a slow Stats delays it
  (health Watch holds no thread at all);
the pools start threads as calls need them and a thread idle for `rpc_idle_s` exits
(`ShrinkingThreadPool`). grpc's own `maximum_concurrent_rpcs` is only a backstop
against floods (`max_concurrent_rpcs` + `_BACKLOG` running or queued calls):
generation holds at most `max_concurrent_rpcs` of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from jaxpd.serving.admission import AdmissionController
from jaxpd.serving.pool import ShrinkingThreadPool, health_handler
from jaxpd.serving.prometheus import MetricsEndpoint, ServingCollector, ServingMetrics
from jaxpd.serving.generation import SERVICE_NAME, GenerationServicer

if TYPE_CHECKING:
    from jaxpd.llm import LLM

_SPARE_THREADS = 4       # beyond max_concurrent_rpcs: refusals, Tokenize, reflection
_CONTROL_THREADS = 4     # ModelInfo, Stats
_HEALTH_THREADS = 2      # health Check
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
                 metrics_port: int | None = None, max_concurrent_rpcs: int = 128,
                 max_prompt_bytes: int | None = None, rpc_idle_s: float = 30.0,
                 tls: grpc.ServerCredentials | None = None):
        self.metrics = ServingMetrics()
        self.servicer = GenerationServicer(AdmissionController(slo_ttft_ms / 1000), self.metrics,
                                           max_concurrent_rpcs, max_prompt_bytes)
        self.health = health.HealthServicer()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._executor = ShrinkingThreadPool(max_concurrent_rpcs + _SPARE_THREADS,
                                             "jaxpd-grpc", rpc_idle_s)
        self._control_pool = ShrinkingThreadPool(_CONTROL_THREADS, "jaxpd-grpc-control",
                                                 rpc_idle_s)
        self._health_pool = ShrinkingThreadPool(_HEALTH_THREADS, "jaxpd-grpc-health",
                                                rpc_idle_s)
        max_message = max(_GRPC_MAX_MESSAGE, (max_prompt_bytes or 0) + 64 * 1024)
        self._grpc = grpc.server(self._executor,
                                 maximum_concurrent_rpcs=max_concurrent_rpcs + _BACKLOG,
                                 options=[("grpc.max_receive_message_length", max_message)])
        self._grpc.add_generic_rpc_handlers((self.servicer.handlers(self._control_pool),
                                             health_handler(self.health, self._health_pool)))
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = (self._grpc.add_secure_port(address, tls) if tls is not None
                         else self._grpc.add_insecure_port(address))
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.host = host
        self._grpc.start()
        self._metrics_endpoint = None
        if metrics_port is not None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(ServingCollector(self.metrics, self.servicer.stats))
            try:
                self._metrics_endpoint = MetricsEndpoint(registry, host, metrics_port)
            except OSError:
                self._grpc.stop(0)
                raise
        self.metrics_port = None if self._metrics_endpoint is None else self._metrics_endpoint.port
        self._stopped = False

    def attach(self, llm: LLM) -> None:
        """Serve `llm` (loaded and warm): health flips to SERVING."""
        self.servicer.attach(llm)
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING (a router whose last decode worker left)."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

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
        self.health.enter_graceful_shutdown()
        self.servicer.drain()
        if self.servicer.llm is not None and not self.servicer.wait_generation_done(grace_s):
            self.servicer.abort_all("shutdown")
            self.servicer.wait_generation_done(_FINAL_MESSAGE_S)
        self._grpc.stop(0).wait()
        self._executor.shutdown(wait=True)
        self._control_pool.shutdown(wait=True)
        self._health_pool.shutdown(wait=True)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
