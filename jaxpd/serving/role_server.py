"""A single-role worker process's RPC service (prefill or decode), for the router.

Prefill worker: `Prefill` submits the request to its prefill-only engine with the
chosen decode worker as the KV destination and answers once the KV is handed off (or
the first token already finished the request). Decode worker: `Decode` registers a
mirror of the request (its KV arrives through the connector; or, with `local`, it is
prefilled right here) and streams its tokens. A cancelled RPC aborts the request, so
its slot and pages are freed by the engine's next iteration.
"""
from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxpd.engine.engine import Engine
from jaxpd.errors import QueueFull
from jaxpd.request import Request, State
from jaxpd.serving.role_rpc import ROLE_SERVICE, register, stream_handler, unary_handler

_log = logging.getLogger(__name__)


class RoleService:
    def __init__(self, engine: Engine, kv_address: str, model_path: str):
        self.engine = engine
        self.kv_address = kv_address
        self.model_path = model_path
        self.role = "prefill" if engine.prefill_loop is not None else "decode"

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(ROLE_SERVICE, {
            "Info": unary_handler(self.Info), "Prefill": unary_handler(self.Prefill),
            "Decode": stream_handler(self.Decode), "Reprefill": unary_handler(self.Reprefill),
            "Abort": unary_handler(self.Abort)})

    def Info(self, msg, context) -> dict:
        s = self.engine.stats()
        return {"role": self.role, "mesh": s.mesh, "kv_address": self.kv_address,
                "model": self.model_path, "free_slots": s.slots_total - s.slots_active,
                "free_pages": s.pages_total - s.pages_used, "queue": s.queue_waiting,
                "transfers": s.transfers, "layerwise_transfers": s.layerwise_transfers,
                "transfer_failures": s.transfer_failures}

    def Prefill(self, msg, context) -> dict:
        self._require("prefill", context)
        r = _request(msg["request"], context, State.WAITING)
        r.destination = msg["destination"]
        self._submit(r, context)
        context.add_callback(lambda: self.engine.abort(r.request_id, "router cancelled"))
        tokens = []
        while True:
            ids, finish = r.events.get()
            tokens += ids
            if finish == "handed_off":
                return {"status": "handed_off"}
            if finish == "abort":
                context.abort(grpc.StatusCode.UNAVAILABLE, r.abort_reason or "aborted")
            if finish is not None:
                return {"status": "finished", "token_ids": tokens, "finish_reason": finish}

    def Decode(self, msg, context):
        self._require("decode", context)
        local = bool(msg.get("local"))
        r = _request(msg["request"], context, State.WAITING if local else State.TRANSFERRING)
        if local:
            self._submit(r, context)
        else:
            self.engine.register(r)
        context.add_callback(lambda: self.engine.abort(r.request_id, "router cancelled"))
        yield {"registered": True}
        while True:
            ids, finish = r.events.get()
            yield {"token_ids": ids, "finish": finish, "abort_reason": r.abort_reason}
            if finish is not None:
                return

    def Reprefill(self, msg, context) -> dict:
        self._require("decode", context)
        return {"ok": self.engine.reprefill(msg["request_id"])}

    def Abort(self, msg, context) -> dict:
        return {"aborted": self.engine.abort(msg["request_id"], msg.get("reason") or "cancelled")}

    def _require(self, role: str, context) -> None:
        if self.role != role:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is a {self.role} worker, not a {role} worker")

    def _submit(self, r: Request, context) -> None:
        try:
            self.engine.submit(r)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (ValueError, RuntimeError) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def _request(wire: dict, context, state: State) -> Request:
    try:
        return Request.from_wire(wire, state)
    except (KeyError, TypeError, ValueError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}")


class RoleServer:
    """gRPC server of a worker: the Worker service plus standard health checking
    (SERVING once started: the engine is built and warm by then)."""

    def __init__(self, service: RoleService, host: str, port: int, max_workers: int = 64):
        self.service = service
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers,
                                                              thread_name_prefix="jaxpd-worker"))
        self._server.add_generic_rpc_handlers((service.handlers(),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()

    def start(self) -> None:
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    def register_with(self, router_address: str, backoff_s: float = 0.2,
                      max_backoff_s: float = 5.0) -> threading.Thread:
        """Announce this worker to the router, retrying with backoff until it answers
        (workers and router may start in any order)."""
        def loop():
            delay = backoff_s
            while not self._stop.is_set():
                try:
                    register(router_address, self.service.role, self.address, timeout=5)
                    _log.info("registered with router %s", router_address)
                    return
                except grpc.RpcError:
                    self._stop.wait(delay)
                    delay = min(delay * 2, max_backoff_s)
        t = threading.Thread(target=loop, name="jaxpd-register", daemon=True)
        t.start()
        return t

    def stop(self, grace: float = 5.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()


def make_connector(role: str, transport: str, host: str):
    """The cross-process connector of a worker, and the address its peers use."""
    if transport == "transfer_server":
        from jaxpd.transfer import transfer_server as ts
        options = ts.TransferServerOptions(transfer_address=f"{host}:0",
                                           transport_addresses=(f"{host}:0",))
        kind = ts.TransferServerSender if role == "prefill" else ts.TransferServerReceiver
        conn = kind(control_address=f"{host}:0", options=options)
        return conn, conn.control_address
    if transport == "grpc":
        from jaxpd.transfer.grpc_stream import GrpcReceiver, GrpcSender
        if role == "prefill":
            return GrpcSender(), ""
        conn = GrpcReceiver(address=f"{host}:0")
        return conn, conn.address
    raise ValueError(f"kv_transport must be 'transfer_server' or 'grpc', got {transport!r}")


def serve_role(role: str, model: str | None, host: str, port: int, router: str | None,
                 transport: str, stop: threading.Event, say, llm_options: dict) -> int:
    """Run a prefill or decode worker process until `stop` is set."""
    from jaxpd.llm import LLM

    connector, kv_address = make_connector(role, transport, host)
    llm = LLM(model, connector=connector, progress=say, **llm_options)
    server = RoleServer(RoleService(llm.engine, kv_address, llm.model_path), host, port)
    try:
        server.start()
        if router:
            server.register_with(router)
        say(f"jaxpd {role} worker on {server.address} (mesh {llm.config.mesh}, "
            f"kv {transport} {kv_address or 'sender'})")
        stop.wait()
    finally:
        server.stop()
        llm.shutdown()
    return 0
