"""A single-role worker process's RPC service (prefill or decode), for the router.

Prefill worker: `Prefill` submits the request to its prefill-only engine with the
chosen decode worker as the KV destination and answers once the KV is handed off (or
the first token already finished the request). Decode worker: `Decode` registers a
mirror of the request (its KV arrives through the connector; or, with `local`, it is
prefilled right here) and streams its tokens (with their log-probabilities when the
request asks for them), with an {"alive"} event after each
second without one so the router can tell a slow request from a frozen worker. A
cancelled RPC aborts the request, so its slot and pages are freed by the engine's
next iteration. A router that stops reading a stream is cut off past `max_buffered`
unread events (`SLOW_READER`).

On the router's command (`SwitchRole`) a worker drains and becomes the other role at a
new epoch (`role_switch`); a call naming another epoch is refused.

Nothing a peer sends is trusted: every request is rebuilt from its wire form (each
field's type checked) and checked against this worker's own limits by the engine's one
check as it is submitted or registered (`Requests.check`; INVALID_ARGUMENT naming the
field) before any loop sees it, and every RPC is authenticated by the server's
`InternalAuth`. A worker whose engine died answers UNAVAILABLE and its health
turns NOT_SERVING (the event loop watches `engine.error`); it also stops
heartbeating, so the router drops it when its lease runs out.

The server is `grpc.aio`: Prefill, Decode, Reprefill and Abort are coroutines on its
event loop (what they do there is short and never blocks: validate, submit or
register, abort), and a request's events reach them through an `AsyncOutputs`, so a
call in flight costs no thread. Handlers that block (Info reads the engine's stats,
SwitchRole drains and rebuilds, Migrate sends a held request's KV) are plain
functions grpc runs on a small pool. A handler refuses a call by raising `Refusal`.
Threads, whatever the number of calls: `jaxpd-worker-loop` (the event loop: every call, health), `jaxpd-worker-rpc-*` (the
blocking handlers, at most `RPC_THREADS`, idle ones exit) and `jaxpd-register`
(register, then heartbeat every `heartbeat_s`; a refusal from the router is final),
with a sidecar process that beats in its place while the GIL is held (`heartbeat`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.engine.compile.background import compilers
from jaxpd.engine.engine import Engine
from jaxpd.errors import DuplicateRequest, QueueFull
from jaxpd.output_sink import MAX_BUFFERED, AsyncOutputs
from jaxpd.stats import COUNTERS
from jaxpd.request import Request, State
from jaxpd.serving.pool import ShrinkingThreadPool
from jaxpd.serving.migration import MIGRATING, MigrationOutbox, NotHeld
from jaxpd.serving.role_switch import RoleSwitch
from jaxpd.serving.heartbeat import HeartbeatSidecar
from jaxpd.serving.role_rpc import (MAX_ADDRESS_LEN, MAX_REASON_LEN, ROLE_SERVICE,
                                    SERVER_KEEPALIVE, Refusal, WorkerInfo, register_body,
                                    router_identity, send_register, stream_handler,
                                    unary_handler)
from jaxpd.validation import check_request_id

_log = logging.getLogger(__name__)
ALIVE_EVERY_S = 1.0
RPC_THREADS = 8          # the blocking handlers' pool (Info, SwitchRole, Migrate)
MAX_CALLS = 16384        # grpc's backstop on calls at once
# Refusals that retrying cannot cure: the worker stops and says why.
_FINAL_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                   grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class RoleService:
    def __init__(self, engine: Engine, kv_address: str, kv_transport: str = "grpc",
                 alive_every_s: float = ALIVE_EVERY_S, max_buffered: int = MAX_BUFFERED):
        self.engine = engine
        self.kv_address = kv_address
        self.kv_transport = kv_transport
        self.alive_every_s = alive_every_s
        self.max_buffered = max_buffered
        self.role = "prefill" if engine.prefill_loop is not None else "decode"
        self.tokenizer = router_identity(engine.model.path)
        self.epoch = 1                  # one more per role switch (`role_switch`)
        self.switcher: RoleSwitch | None = None     # None: this worker keeps its role
        # A decode worker's running requests move out with their KV when it drains
        # (`migration`); None: they are prefilled again elsewhere.
        self.migration: MigrationOutbox | None = None
        self.stopping: str | None = None    # why, once the process is shutting down
        # Tells the router this worker drains (why) and returns how many other decode
        # workers it could move its requests to (`RoleServer.tell_draining`); None:
        # nobody to ask.
        self.decode_peers: Callable[[str], int | None] | None = None

    @property
    def draining(self) -> str | None:
        """Why this worker takes no new request (shutting down, switching roles, moving
        its requests out), or None. Its heartbeat says so, so the router stops choosing
        it before it goes."""
        switching = self.switcher.draining if self.switcher is not None else None
        moving = self.migration.draining if self.migration is not None else None
        return self.stopping or switching or moving

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
            "Abort": unary_handler(self.Abort), "SwitchRole": unary_handler(self.SwitchRole),
            "Migrate": unary_handler(self.Migrate)})

    @property
    def error(self) -> BaseException | None:
        """Why this worker cannot serve: its engine failed, or a role switch did."""
        switch = self.switcher.error if self.switcher is not None else None
        return switch or self.engine.error

    def Info(self, msg, context) -> dict:
        self._alive()
        s = self.engine.stats()
        return {**self.info("").to_wire(), **self.load(), "draining": self.draining,
                "mesh": s.mesh,
                "model_path": self.engine.model.path, "transfers": s.transfers,
                "slots_total": s.slots_total, "pages_total": s.pages_total,
                "layerwise_transfers": s.layerwise_transfers,
                "transfer_failures": s.transfer_failures, "transfer_bytes": s.transfer_bytes,
                "counters": {name: s[name] for name in COUNTERS},
                "compiles_pending": sum(c.pending for c in compilers(self.engine))}

    async def Prefill(self, msg, context) -> dict:
        self._require("prefill", msg)
        r = self._request(msg, State.WAITING)
        destination = msg.get("destination")
        if not isinstance(destination, str) or not 0 < len(destination) <= MAX_ADDRESS_LEN:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"destination must be a host:port of at most {MAX_ADDRESS_LEN} "
                          f"characters")
        r.destination = destination
        held = len(r.output_ids)
        outputs = self._outputs(r)
        self._submit(r)
        self._abort_at_end(r, context)
        tokens = []
        while True:
            _, (ids, finish) = await outputs.get()
            tokens += ids
            if finish == "handed_off":
                return {"status": "handed_off"}
            if finish == "abort":
                raise Refusal(grpc.StatusCode.UNAVAILABLE, r.abort_reason or "aborted")
            if finish is not None:
                return {"status": "finished", "token_ids": tokens, "finish_reason": finish,
                        **_logprobs_of(r, held, len(tokens))}

    async def Decode(self, msg, context):
        self._require("decode", msg)
        local = bool(msg.get("local"))
        r = self._request(msg, State.WAITING if local else State.TRANSFERRING)
        sent = len(r.output_ids)            # tokens the router holds already (a failover)
        told_move_failure = False
        outputs = self._outputs(r)
        if local:
            self._submit(r)
        else:
            self._alive()
            try:
                self.engine.register(r)
            except DuplicateRequest as e:
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
            except ValueError as e:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}") from None
        self._abort_at_end(r, context)
        yield {"registered": True}
        while True:
            try:
                async with asyncio.timeout(self.alive_every_s):
                    _, (ids, finish) = await outputs.get()
            except TimeoutError:
                yield {"alive": True}       # lets the router tell slow from frozen
                continue
            if finish == MIGRATING:         # it moves on with its KV (`Migrate`)
                yield {"migrating": True}
                return
            event = {"token_ids": ids, "finish": finish, "abort_reason": r.abort_reason,
                     **_logprobs_of(r, sent, len(ids))}
            if r.move_failure is not None and not told_move_failure:
                # Its KV was to come from a drained decode worker and did not: it was
                # prefilled again here (the router counts the failed move).
                event["migration_failed"] = _printable(r.move_failure, MAX_REASON_LEN)
                told_move_failure = True
            yield event
            sent += len(ids)
            if finish is not None:
                return

    async def Reprefill(self, msg, context) -> dict:
        self._require("decode", msg)
        return {"ok": self.engine.reprefill(_request_id(msg))}

    async def Abort(self, msg, context) -> dict:
        self.check_epoch(msg)
        request_id = _request_id(msg)
        reason = msg.get("reason") or "cancelled"
        if not isinstance(reason, str) or len(reason) > MAX_REASON_LEN or not reason.isprintable():
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"reason must be printable text of at most {MAX_REASON_LEN} characters")
        return {"aborted": self.engine.abort(request_id, reason)}

    def Migrate(self, msg, context) -> dict:
        """Send a migrating request's held KV to the decode worker at `destination`
        (its KV address); UNAVAILABLE with the reason when the move fails. It blocks
        on the transfer, so grpc runs it on the blocking handlers' pool."""
        self.check_epoch(msg)
        request_id = _request_id(msg)
        destination = msg.get("destination")
        if not isinstance(destination, str) or not 0 < len(destination) <= MAX_ADDRESS_LEN:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"destination must be a host:port of at most {MAX_ADDRESS_LEN} "
                          f"characters")
        if self.migration is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this worker moves no request (started without migrate_on_drain)")
        try:
            self.migration.send(request_id, destination)
        except NotHeld as e:
            raise Refusal(grpc.StatusCode.NOT_FOUND, str(e)) from None
        except Exception as e:      # noqa: BLE001 -- a failed move is the router's to handle
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"moving {request_id!r} to {destination} failed: "
                          f"{type(e).__name__}: {e}"[:MAX_REASON_LEN * 4]) from None
        return {"sent": True}

    def SwitchRole(self, msg, context) -> dict:
        self._alive()
        if self.switcher is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this {self.role} worker cannot switch roles (a mesh across "
                          f"processes, or started without one)")
        return self.switcher.handle(msg)

    # ---- a call's request ---------------------------------------------------------

    def _outputs(self, r: Request) -> AsyncOutputs:
        """Where `r`'s events go: a deque the calling coroutine awaits."""
        outputs = AsyncOutputs(asyncio.get_running_loop(), 1, self.max_buffered)
        r.events = outputs.sinks[0]
        return outputs

    def _abort_at_end(self, r: Request, context) -> None:
        """The call's end aborts `r` if it still runs: at once on a cancel (the router
        gave up, or the server stops), a no-op after a normal end."""
        engine = self.engine
        context.add_done_callback(
            lambda _: r.is_final or engine.abort(r.request_id, "router cancelled"))

    # ---- checks: each raises `Refusal` -------------------------------------------------

    def _alive(self) -> None:
        if self.error is not None:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"this {self.role} worker's engine failed: {self.error!r}")

    def check_epoch(self, msg: dict) -> None:
        """A call for another epoch of this worker is refused: it was meant for the
        role it had before a switch (or a later one)."""
        epoch = msg.get("epoch", 1)
        if epoch != self.epoch:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale epoch: the call is for epoch {epoch!r} of this worker, "
                          f"which is now a {self.role} worker at epoch {self.epoch}")

    def _require(self, role: str, msg: dict) -> None:
        self._alive()
        draining = self.draining
        if draining is not None:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, draining)
        self.check_epoch(msg)
        if self.role != role:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is a {self.role} worker, not a {role} worker")

    def _request(self, msg: dict, state: State) -> Request:
        """The request from its wire form, checked against this worker's limits
        (`Requests.check`): a peer's request is as untrusted as a client's, and this is
        the internal plane's one check of it."""
        try:
            r = Request.from_wire(msg["request"], state)
            self.engine.requests.check(r)
            return r
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"bad request: {_describe(e)}") from None

    def _submit(self, r: Request) -> None:
        try:
            self.engine.submit(r)
        except QueueFull as e:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except DuplicateRequest as e:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}") from None
        except RuntimeError as e:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(e)) from None


def _request_id(msg: dict) -> str:
    try:
        return check_request_id(msg.get("request_id"))
    except ValueError as e:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _logprobs_of(r: Request, start: int, count: int) -> dict:
    """The "logprobs" of an answer carrying `r`'s output tokens [start, start + count)
    (recorded before the tokens are announced), when it asks for them."""
    if r.logprobs is None:
        return {}
    return {"logprobs": r.logprobs[start:start + count]}


def _printable(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, anything unprintable replaced."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit]) or "?"


def _describe(e: Exception) -> str:
    return f"missing field {e}" if isinstance(e, KeyError) else str(e)


class RoleServer:
    """gRPC server of a worker: the Worker service plus standard health checking
    (SERVING once started: the engine is built and warm by then; NOT_SERVING once its
    engine has failed). Every call is authenticated by `auth`. `max_calls`: calls at
    once (grpc refuses more, RESOURCE_EXHAUSTED), a backstop only: the engine's own
    queue bound refuses first."""

    def __init__(self, service: RoleService, host: str, port: int,
                 auth: InternalAuth = NO_AUTH, max_calls: int = MAX_CALLS):
        self.service = service
        self.auth = auth
        self._pool = ShrinkingThreadPool(RPC_THREADS, "jaxpd-worker-rpc")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="jaxpd-worker-loop", daemon=True)
        self._thread.start()
        try:
            self.port = self._on_loop(self._bind(f"{host}:{port}", max_calls))
        except BaseException:
            self._close_loop()
            raise
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._watch: asyncio.Task | None = None
        self.refused: str | None = None     # why the router refused this worker
        self._router: tuple[str, float] | None = None   # (address, heartbeat_s) once registering
        self._sidecar: HeartbeatSidecar | None = None    # while the heartbeat loop runs

    def _on_loop(self, coro, timeout: float | None = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _bind(self, address: str, max_calls: int) -> int:
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server(self._pool, options=SERVER_KEEPALIVE,
                                       interceptors=self.auth.aio_server_interceptors(),
                                       maximum_concurrent_rpcs=max_calls)
        self._server.add_generic_rpc_handlers((self.service.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        return self.auth.add_port(self._server, address)

    def start(self) -> None:
        async def start():
            await self._server.start()
            await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
            self._watch = asyncio.get_running_loop().create_task(self._watch_engine())
        self._on_loop(start())

    async def _watch_engine(self) -> None:
        while self.service.error is None:
            await asyncio.sleep(0.2)
        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        _log.error("engine failed (%r): health NOT_SERVING", self.service.error)

    def register_with(self, router_address: str, heartbeat_s: float = 1.0,
                      on_refused: Callable[[str], None] | None = None,
                      sidecar_beats: bool = True) -> threading.Thread:
        """Announce this worker to the router and heartbeat every `heartbeat_s` with its
        load (the router drops a worker whose lease runs out). Retries with backoff while
        the router does not answer (workers and router may start in any order); a
        refusal (mismatched model or limits, bad credentials) is logged, kept in
        `refused`, passed to `on_refused`, and ends the loop. `sidecar_beats`: a
        `HeartbeatSidecar` beats in this loop's place while the worker makes progress
        but its own beats are late (the GIL is held), until the loop ends."""
        def loop():
            # Beats in this thread's place while a long C++ call holds the GIL (`heartbeat`).
            sidecar = HeartbeatSidecar.start(router_address, heartbeat_s, self.auth) \
                if sidecar_beats else None
            self._sidecar = sidecar
            try:
                beat(sidecar)
            finally:
                self._sidecar = None
                if sidecar is not None:
                    sidecar.close()

        def beat(sidecar):
            delay, registered = heartbeat_s, False
            while not self._stop.is_set():
                if self.service.error is not None:
                    return                      # a dead engine: let the lease run out
                # Read each time: a role switch changes them.
                info = self.service.info(self.address)
                journal = self.service.engine.cache_journal
                try:
                    prefix = journal.take() if journal is not None else None
                    load, draining = self.service.load(), self.service.draining
                    if sidecar is not None:
                        # What it repeats (never the prefix), handed over before the
                        # send: a repeat after a role switch must say the new role.
                        sidecar.update(register_body(info, load, None, draining))
                    answer = send_register(router_address,
                                           register_body(info, load, prefix, draining),
                                           self.auth, timeout=max(heartbeat_s, 2.0))
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
        self._router = (router_address, heartbeat_s)
        t.start()
        return t

    def announce_draining(self, why: str) -> int | None:
        """Take no new request (`RoleService.stopping`) and tell the router now
        (`tell_draining`)."""
        self.service.stopping = why
        return self.tell_draining(why)

    def tell_draining(self, why: str) -> int | None:
        """Tell the router now, in one heartbeat out of turn, that this worker drains,
        so it stops choosing it before its next beat. Returns the other decode workers
        the router could move this one's requests to, as it answered; None when it did
        not answer (or this worker registers with none). Best effort: a router that
        does not answer learns it from the next beat (which says it while the worker
        drains), or drops the worker when its lease runs out."""
        if self._router is None or self.refused is not None or self.service.error is not None:
            return None
        address, heartbeat_s = self._router
        body = register_body(self.service.info(self.address), self.service.load(),
                             draining=why)
        sidecar = self._sidecar
        if sidecar is not None:
            sidecar.update(body)
        try:
            answer = send_register(address, body, self.auth, timeout=max(heartbeat_s, 2.0))
        except grpc.RpcError as e:
            _log.warning("could not tell router %s that this worker drains: %s", address,
                         e.code())
            return None
        peers = answer.get("decode_peers") if isinstance(answer, dict) else None
        ok = isinstance(peers, int) and not isinstance(peers, bool) and peers >= 0
        return peers if ok else None

    def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING and new calls refused; calls in flight get `grace` seconds,
        then are cancelled (their requests abort); the threads are joined. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()

        async def stop():
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
            if self._watch is not None:
                self._watch.cancel()
        self._on_loop(stop(), timeout=None)
        self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._pool.shutdown(wait=True)


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
