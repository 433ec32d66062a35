"""A single-role worker process's RPC service (prefill or decode), for the router.

Prefill worker: `Prefill` submits the request to its prefill-only engine with the
chosen decode worker as the KV destination and answers once the KV is handed off (or
the first token already finished the request). Decode worker: `Decode` registers a
mirror of the request (its KV arrives through the connector; or, with `local`, it is
prefilled right here) and streams its tokens (with their log-probabilities when the
request asks for them), with an {"alive"} event after each
second without one so the router can tell a slow request from a frozen worker. A
cancelled RPC aborts the request, so its slot and pages are freed by the engine's
next iteration.

On the router's command (`SwitchRole`) a worker drains and becomes the other role at a
new epoch (`role_switch`); a call naming another epoch is refused.

Nothing a peer sends is trusted: every request is rebuilt from its wire form (each
field's type checked) and checked against this worker's own limits by the engine's one
check as it is submitted or registered (`Requests.check`; INVALID_ARGUMENT naming the
field) before any loop sees it, and every RPC is authenticated by the server's
`InternalAuth`. A worker whose engine died answers UNAVAILABLE and its health
turns NOT_SERVING (a `jaxpd-role-health` thread watches `engine.error`); it also stops
heartbeating, so the router drops it when its lease runs out.

Threads: the gRPC pool (`jaxpd-worker-*`), `jaxpd-role-health`, and `jaxpd-register`
(register, then heartbeat every `heartbeat_s`; a refusal from the router is final).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.engine.background_compile import compilers
from jaxpd.engine.engine import Engine
from jaxpd.errors import DuplicateRequest, QueueFull
from jaxpd.stats import COUNTERS
from jaxpd.request import Request, State
from jaxpd.serving.pool import ShrinkingThreadPool, health_handler
from jaxpd.serving.role_switch import RoleSwitch
from jaxpd.serving.role_rpc import (MAX_ADDRESS_LEN, MAX_REASON_LEN, ROLE_SERVICE,
                                    SERVER_KEEPALIVE, WorkerInfo, register, router_identity,
                                    stream_handler, unary_handler)
from jaxpd.validation import check_request_id

_log = logging.getLogger(__name__)
ALIVE_EVERY_S = 1.0
# Refusals that retrying cannot cure: the worker stops and says why.
_FINAL_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                   grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class RoleService:
    def __init__(self, engine: Engine, kv_address: str, kv_transport: str = "grpc",
                 alive_every_s: float = ALIVE_EVERY_S):
        self.engine = engine
        self.kv_address = kv_address
        self.kv_transport = kv_transport
        self.alive_every_s = alive_every_s
        self.role = "prefill" if engine.prefill_loop is not None else "decode"
        self.tokenizer = router_identity(engine.model.path)
        self.epoch = 1                  # one more per role switch (`role_switch`)
        self.switcher: RoleSwitch | None = None     # None: this worker keeps its role

    def info(self, address: str) -> WorkerInfo:
        c, m = self.engine.config, self.engine.model.cfg
        return WorkerInfo(role=self.role, address=address, kv_address=self.kv_address,
                          model=self.engine.fingerprint, tokenizer=self.tokenizer,
                          max_model_len=c.max_model_len,
                          max_prompt_len=c.max_prompt_len, vocab_size=m.vocab_size,
                          page_size=c.page_size, dtype=c.dtype, kv_transport=self.kv_transport,
                          epoch=self.epoch)

    def load(self) -> dict:
        s = self.engine.stats()
        return {"free_slots": s.slots_total - s.slots_active,
                "free_pages": s.pages_total - s.pages_used, "queue": s.queue_waiting}

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(ROLE_SERVICE, {
            "Info": unary_handler(self.Info), "Prefill": unary_handler(self.Prefill),
            "Decode": stream_handler(self.Decode), "Reprefill": unary_handler(self.Reprefill),
            "Abort": unary_handler(self.Abort), "SwitchRole": unary_handler(self.SwitchRole)})

    @property
    def error(self) -> BaseException | None:
        """Why this worker cannot serve: its engine failed, or a role switch did."""
        switch = self.switcher.error if self.switcher is not None else None
        return switch or self.engine.error

    def Info(self, msg, context) -> dict:
        self._alive(context)
        s = self.engine.stats()
        return {**self.info("").to_wire(), **self.load(), "mesh": s.mesh,
                "model_path": self.engine.model.path, "transfers": s.transfers,
                "slots_total": s.slots_total, "pages_total": s.pages_total,
                "layerwise_transfers": s.layerwise_transfers,
                "transfer_failures": s.transfer_failures, "transfer_bytes": s.transfer_bytes,
                "counters": {name: s[name] for name in COUNTERS},
                "compiles_pending": sum(c.pending for c in compilers(self.engine))}

    def Prefill(self, msg, context) -> dict:
        self._require("prefill", msg, context)
        r = self._request(msg, context, State.WAITING)
        destination = msg.get("destination")
        if not isinstance(destination, str) or not 0 < len(destination) <= MAX_ADDRESS_LEN:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"destination must be a host:port of at most {MAX_ADDRESS_LEN} "
                          f"characters")
        r.destination = destination
        held = len(r.output_ids)
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
                return {"status": "finished", "token_ids": tokens, "finish_reason": finish,
                        **_logprobs_of(r, held, len(tokens))}

    def Decode(self, msg, context):
        self._require("decode", msg, context)
        local = bool(msg.get("local"))
        r = self._request(msg, context, State.WAITING if local else State.TRANSFERRING)
        sent = len(r.output_ids)            # tokens the router holds already (a failover)
        if local:
            self._submit(r, context)
        else:
            self._alive(context)
            try:
                self.engine.register(r)
            except DuplicateRequest as e:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}")
        context.add_callback(lambda: self.engine.abort(r.request_id, "router cancelled"))
        yield {"registered": True}
        while True:
            try:
                ids, finish = r.events.get(timeout=self.alive_every_s)
            except queue.Empty:
                yield {"alive": True}       # lets the router tell slow from frozen
                continue
            yield {"token_ids": ids, "finish": finish, "abort_reason": r.abort_reason,
                   **_logprobs_of(r, sent, len(ids))}
            sent += len(ids)
            if finish is not None:
                return

    def Reprefill(self, msg, context) -> dict:
        self._require("decode", msg, context)
        return {"ok": self.engine.reprefill(_request_id(msg, context))}

    def Abort(self, msg, context) -> dict:
        self.check_epoch(msg, context)
        request_id = _request_id(msg, context)
        reason = msg.get("reason") or "cancelled"
        if not isinstance(reason, str) or len(reason) > MAX_REASON_LEN or not reason.isprintable():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reason must be printable text of at most {MAX_REASON_LEN} characters")
        return {"aborted": self.engine.abort(request_id, reason)}

    # ---- checks -------------------------------------------------------------------

    def SwitchRole(self, msg, context) -> dict:
        self._alive(context)
        if self.switcher is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this {self.role} worker cannot switch roles (a mesh across "
                          f"processes, or started without one)")
        return self.switcher.handle(msg, context)

    def _alive(self, context) -> None:
        if self.error is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"this {self.role} worker's engine failed: {self.error!r}")

    def check_epoch(self, msg: dict, context) -> None:
        """A call for another epoch of this worker is refused: it was meant for the
        role it had before a switch (or a later one)."""
        epoch = msg.get("epoch", 1)
        if epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale epoch: the call is for epoch {epoch!r} of this worker, "
                          f"which is now a {self.role} worker at epoch {self.epoch}")

    def _require(self, role: str, msg: dict, context) -> None:
        self._alive(context)
        draining = self.switcher.draining if self.switcher is not None else None
        if draining is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, draining)
        self.check_epoch(msg, context)
        if self.role != role:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is a {self.role} worker, not a {role} worker")

    def _request(self, msg: dict, context, state: State) -> Request:
        """The request from its wire form (a peer's request is as untrusted as a
        client's: the engine checks it against this worker's limits on submit or
        register, `Requests.check`)."""
        try:
            return Request.from_wire(msg["request"], state)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {_describe(e)}")

    def _submit(self, r: Request, context) -> None:
        try:
            self.engine.submit(r)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DuplicateRequest as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}")
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def _request_id(msg: dict, context) -> str:
    try:
        return check_request_id(msg.get("request_id"))
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def _logprobs_of(r: Request, start: int, count: int) -> dict:
    """The "logprobs" of an answer carrying `r`'s output tokens [start, start + count)
    (recorded before the tokens are announced), when it asks for them."""
    if r.logprobs is None:
        return {}
    return {"logprobs": r.logprobs[start:start + count]}


def _describe(e: Exception) -> str:
    return f"missing field {e}" if isinstance(e, KeyError) else str(e)


class RoleServer:
    """gRPC server of a worker: the Worker service plus standard health checking
    (SERVING once started: the engine is built and warm by then; NOT_SERVING once its
    engine has failed). Every call is authenticated by `auth`."""

    def __init__(self, service: RoleService, host: str, port: int,
                 auth: InternalAuth = NO_AUTH, max_workers: int = 1024):
        self.service = service
        self.auth = auth
        # One thread per Decode stream (each request registered here holds one for its
        # life): a shrinking pool, so a burst's threads go with the burst; health Check
        # on a pool of its own, so a probe never waits behind streams.
        self._pool = ShrinkingThreadPool(max_workers, "jaxpd-worker")
        self._health_pool = ShrinkingThreadPool(2, "jaxpd-worker-health")
        self._server = grpc.server(self._pool, interceptors=auth.server_interceptors(),
                                   options=SERVER_KEEPALIVE)
        self._health = health.HealthServicer()
        self._server.add_generic_rpc_handlers((service.handlers(),
                                               health_handler(self._health, self._health_pool)))
        self.port = auth.add_port(self._server, f"{host}:{port}")
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self.refused: str | None = None     # why the router refused this worker

    def start(self) -> None:
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._watch_engine, name="jaxpd-role-health",
                         daemon=True).start()

    def _watch_engine(self) -> None:
        while not self._stop.wait(0.2):
            if self.service.error is not None:
                self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                _log.error("engine failed (%r): health NOT_SERVING", self.service.error)
                return

    def register_with(self, router_address: str, heartbeat_s: float = 1.0,
                      on_refused: Callable[[str], None] | None = None) -> threading.Thread:
        """Announce this worker to the router and heartbeat every `heartbeat_s` with its
        load (the router drops a worker whose lease runs out). Retries with backoff while
        the router does not answer (workers and router may start in any order); a
        refusal (mismatched model or limits, bad credentials) is logged, kept in
        `refused`, passed to `on_refused`, and ends the loop."""
        def loop():
            delay, registered = heartbeat_s, False
            while not self._stop.is_set():
                if self.service.error is not None:
                    return                      # a dead engine: let the lease run out
                # Read each time: a role switch changes them.
                info = self.service.info(self.address)
                journal = self.service.engine.cache_journal
                try:
                    prefix = journal.take() if journal is not None else None
                    answer = register(router_address, info, self.service.load(), self.auth,
                                      timeout=max(heartbeat_s, 2.0), prefix=prefix)
                    if not registered:
                        _log.info("registered with router %s", router_address)
                    registered, delay = True, heartbeat_s
                    if journal is not None and isinstance(answer, dict) and answer.get("resync"):
                        journal.resync()        # it missed one: everything next time
                except grpc.RpcError as e:
                    if journal is not None:
                        journal.resync()        # it may not have arrived
                    if e.code() in _FINAL_REFUSALS:
                        self.refused = f"router {router_address} refused this worker: {e.details()}"
                        _log.error("%s", self.refused)
                        if on_refused is not None:
                            on_refused(self.refused)
                        return
                    registered, delay = False, min(delay * 2, max(5.0, heartbeat_s))
                self._stop.wait(heartbeat_s if registered else delay)
        t = threading.Thread(target=loop, name="jaxpd-register", daemon=True)
        t.start()
        return t

    def stop(self, grace: float = 5.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._pool.shutdown(wait=True)
        self._health_pool.shutdown(wait=True)


def kv_options(host: str, offer_hosts: tuple[str, ...] = ()):
    """A worker's transfer-server options: its data plane on `host`."""
    from jaxpd.transfer.endpoint import TransferServerOptions
    return TransferServerOptions(transfer_address=f"{host}:0",
                                 transport_addresses=(f"{host}:0",), offer_hosts=offer_hosts)


def make_connector(role: str, transport: str, host: str, auth: InternalAuth = NO_AUTH,
                   offer_hosts: tuple[str, ...] = ()):
    """The cross-process connector of a worker, and the address its peers use.
    `offer_hosts`: a decode worker's `TransferServerOptions.offer_hosts`."""
    if transport == "transfer_server":
        from jaxpd.transfer import transfer_server as ts
        options = kv_options(host, offer_hosts)
        kind = ts.TransferServerSender if role == "prefill" else ts.TransferServerReceiver
        conn = kind(control_address=f"{host}:0", options=options, auth=auth)
        return conn, conn.control_address
    if transport == "grpc":
        from jaxpd.transfer.grpc_stream import GrpcReceiver, GrpcSender
        if role == "prefill":
            return GrpcSender(auth=auth), ""
        conn = GrpcReceiver(address=f"{host}:0", auth=auth)
        return conn, conn.address
    raise ValueError(f"kv_transport must be 'transfer_server' or 'grpc', got {transport!r}")
