"""The router: front door of a multi-process deployment.

It speaks the same `Frontend` interface as `LLM`, so the gRPC `Generation` service
(and `generate`/`stream`) run on it unchanged. Workers reach it on a separate,
authenticated *internal* port (`listen`), never on the public one.

Workers. A worker registers on the internal port (`Register`) with its `WorkerInfo`
(model fingerprint, tokenizer, limits, page size, dtype, KV transport) and then
heartbeats the same call every `heartbeat_s` with its load, and while it drains (shutting
down, switching roles) the reason, so nothing new is sent to it. A worker whose tokenizer
or limits differ from the router's is refused with FAILED_PRECONDITION naming the
field; a malformed registration is INVALID_ARGUMENT. A worker whose last heartbeat is older than
`lease_s` is dropped, and every call the router has open on it is cancelled: its
requests fail over exactly as for a SIGKILLed worker. Workers given statically
(`prefill=`, `decode=`) are probed with `Info` instead, checked the same way before
their first use, and count as live while they answer.

Model versions. Workers whose fingerprints (`models.fingerprint`: weights, tokenizer,
attention config, KV dtype, page size) differ serve different *versions*, side by
side: KV of one is meaningless to another, so a prefill worker only ever sends KV to a
decode worker of its own fingerprint. A new request goes to the newest version (by
first registration) that has a live decode and a live prefill worker, else the newest
with a live decode worker (it prefills on its own mesh); it stays on that version for
its whole life, failovers included, and fails with the reason when the version is
gone. This is how a rolling update runs (`launch/rolling_update.sh`).

Each request runs as a coroutine on the router's event loop (`jaxpd-router-loop`; the
steps are `jaxpd.serving.router_flow`, the workers `jaxpd.serving.worker_pool`), so a
request in flight costs no thread; at most `max_queued` are in flight (more:
`QueueFull`):
  1. pick a live decode worker (fewest of our streams, then most free slots in its last
     heartbeat; with `prefix_routing`, one believed to hold the longest prefix of the
     request, `prefix_index`); open its `Decode` stream (it registers the request);
  2. ask a prefill worker (shortest queue first) to prefill it with that decode worker
     as the KV destination -- or the decode worker itself (`Reprefill`), when its cached
     prefix leaves fewer than `prefix_extend_below` tokens or every prefill worker fails;
  3. relay the decode stream's tokens into the request.
If the decode stream breaks (the worker died, lost its lease, or sent nothing -- not
even its once-a-second {"alive"} -- for `stall_timeout_s`), the request is re-run on
another decode worker from prompt + tokens so far (same greedy output: recompute);
with none left it is aborted with a reason. Nothing is dropped silently, nothing waits
forever: every unary RPC has a deadline or (Prefill, Migrate: how long they take depends
on the worker's queue and compiles) ends when its worker's or destination's lease does,
a stream is watched, and every call is cancelled on abort.

A worker changes role on `switch_role(address, role)` (`role_switch`): the
router stops choosing it at once, the worker drains and rebuilds, and its next
heartbeat re-registers it in the new role at a new epoch; the old registration is
dropped like a lost worker (calls still open on it fail over), and every call names
the epoch the router knows, so a call meant for the old role is refused.

The `jaxpd-router-watch` thread expires leases, probes static workers and cancels
stalled streams (`WorkerPool`); `stats()` asks every live worker for `Info` in parallel
(`jaxpd-router-info`) within `info_timeout_s`: a frozen worker costs that once.
Registrations arrive on `jaxpd-router-rpc` threads (at most 16).

SERVING (`ready()`): the router is not shut down and holds at least one live decode
worker (registered with the router's tokenizer and limits, its lease running; or static
and answering its probes). Prefill workers are optional: without one, the decode worker
prefills on its own mesh. Public health follows this at once, both ways, and says why
it cannot serve (`problems()`), e.g. prefill workers whose model no decode worker
serves.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from concurrent import futures

import grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.errors import QueueFull
from jaxpd.frontend import Frontend
from jaxpd.request import Request
from jaxpd.stats import StatsCounter
from jaxpd.serving.prefix_index import PrefixIndex, check_advertisement
from jaxpd.serving.router_config import RouterConfig
from jaxpd.serving.router_flow import RequestFlow
from jaxpd.serving.router_split import deployment_totals
from jaxpd.serving.role_rpc import (ROLES, ROUTER_SERVICE, WorkerInfo, check_draining,
                                    check_load, router_identity, unary_handler)
from jaxpd.serving.worker_pool import WorkerPool
from jaxpd.models.fingerprint import short
from jaxpd.models.source import model_config_and_tokenizer

_log = logging.getLogger(__name__)
__all__ = ["Router", "RouterConfig"]
_SHUTDOWN_S = 10.0      # for the flows of aborted requests to end at shutdown


class Router(Frontend):
    def __init__(self, model_dir: str, config: RouterConfig = RouterConfig(),
                 prefill: tuple[str, ...] = (), decode: tuple[str, ...] = (),
                 auth: InternalAuth = NO_AUTH):
        self.model_path = model_dir
        self.model_config, self.tokenizer = model_config_and_tokenizer(model_dir)
        self.tokenizer_digest = router_identity(model_dir)
        self.config = config
        self.auth = auth
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}
        self._internal: grpc.Server | None = None
        self._closed = threading.Event()
        self.counters = StatsCounter(("requests_submitted", "finished", "aborted",
                                      "decode_failovers", "migrations", "migration_fallbacks",
                                      "migration_failures",
                                      "prefill_failovers", "decode_prefills", "workers_dropped",
                                      "prefix_routed", "prefix_host_routed", "resplits",
                                      "split_vetoes"))
        self.prefix = PrefixIndex(config.page_size) if config.prefix_routing else None
        self.workers = WorkerPool(config, self.tokenizer_digest, self.model_config.vocab_size,
                                  auth, self.counters, self.prefix)
        self.flow = RequestFlow(self.workers, config, self.counters, self.prefix,
                                self.model_config.vocab_size, auth)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                             name="jaxpd-router-loop", daemon=True)
        self._loop_thread.start()
        self._flows: set[futures.Future] = set()
        for a in prefill:
            self.add_static_worker("prefill", a)
        for a in decode:
            self.add_static_worker("decode", a)

    # ---- workers ------------------------------------------------------------------

    def add_static_worker(self, role: str, address: str) -> None:
        """A worker named on the command line: probed with Info, used once it matches."""
        self.workers.add_static(role, address)

    def listen(self, host: str, port: int = 0) -> int:
        """Serve `Register` on the internal port (authenticated by `auth`); returns the
        port. OSError when it cannot bind; AuthConfigError for an open port without auth."""
        self.auth.check_bind(host, "the router's internal port")
        self._rpc_pool = futures.ThreadPoolExecutor(16, thread_name_prefix="jaxpd-router-rpc")
        server = grpc.server(self._rpc_pool, interceptors=self.auth.server_interceptors())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            ROUTER_SERVICE, {"Register": unary_handler(self._register)}),))
        port = self.auth.add_port(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        server.start()
        self._internal = server
        return port

    def _register(self, msg: dict, context) -> dict:
        try:
            info = WorkerInfo.from_wire(msg)
            load = check_load(msg.get("load", {}))
            draining = check_draining(msg.get("draining"))
            prefix = msg.get("prefix")
            if prefix is not None:
                prefix = check_advertisement(prefix)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad registration: {e}")
        refusal = self.admit(info, load, draining=draining)
        if refusal is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        answer = {"lease_s": self.config.lease_s}
        if draining is not None and info.role == "decode":
            answer["decode_peers"] = self.workers.decode_peers(info.address, info.model)
        if self.prefix is None or prefix is None:
            return answer
        applied = self.prefix.advertise(info.address, prefix)
        return {**answer, "resync": not applied}

    def admit(self, info: WorkerInfo, load: dict, static: bool = False,
              draining: str | None = None) -> str | None:
        """Add or refresh a worker (a registration or a heartbeat); the reason it is
        refused, naming the field, or None (`WorkerPool.admit`)."""
        return self.workers.admit(info, load, static, draining)

    def serving_model(self) -> str | None:
        """The fingerprint new requests go to (`WorkerPool.serving_model`)."""
        return self.workers.serving_model()

    @property
    def fingerprint(self) -> str:
        """The serving model's fingerprint ("" while none is servable)."""
        return self.serving_model() or ""

    def problems(self) -> list[str]:
        """Why some live workers cannot serve (`WorkerPool.problems`)."""
        return self.workers.problems()

    def versions(self) -> list[dict]:
        """Every live model version, newest first (`WorkerPool.versions`)."""
        return self.workers.versions()

    def switch_role(self, address: str, role: str, timeout_s: float = 600.0) -> dict:
        """Have the worker at `address` become a `role` worker (`role_switch`): nothing
        new goes to it from now on; it drains, rebuilds and answers its new epoch
        ({"role", "epoch"}); its next heartbeat re-registers it in the new role.
        ValueError for no such live worker or role; RuntimeError if it failed."""
        w = self.workers.get(address)
        if w is None or not w.live or w.info is None:
            raise ValueError(f"no live worker at {address!r}")
        if role not in ROLES or role == w.role:
            raise ValueError(f"role must be the other of {ROLES}, got {role!r} for the "
                             f"{w.role} worker {address}")
        self.workers.set_draining(w, True)
        try:
            answer = w.client.switch_role(role, w.info.epoch, timeout=timeout_s)
        except grpc.RpcError as e:
            self.workers.set_draining(w, False)
            raise RuntimeError(f"the {w.role} worker {address} did not switch to {role}: "
                               f"{e.code()}: {e.details()}") from None
        self.counters.add(resplits=1)
        return answer

    def live_workers(self) -> dict[str, str]:
        """address -> role of every live worker."""
        return self.workers.live_workers()

    def worker_loads(self) -> list[dict]:
        """Each live worker the router may choose (`WorkerPool.worker_loads`)."""
        return self.workers.worker_loads()

    def ready(self) -> bool:
        """SERVING: see the module docstring (at least one live decode worker)."""
        return not self._closed.is_set() and self.serving_model() is not None

    # ---- Frontend -----------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"rt-{secrets.token_hex(8)}"

    def submit(self, request: Request) -> Request:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("router is shut down")
            for k in [k for k, r in self._live.items() if r.is_final]:
                del self._live[k]
            if len(self._live) >= self.config.max_queued:
                raise QueueFull(f"{len(self._live)} requests in flight "
                                f"(max_queued={self.config.max_queued})")
            if request.request_id in self._live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._live[request.request_id] = request
            flow = asyncio.run_coroutine_threadsafe(self.flow.run(request), self._loop)
            self._flows.add(flow)
        flow.add_done_callback(self._flow_done)
        self.counters.add(requests_submitted=1)
        return request

    def _flow_done(self, flow: futures.Future) -> None:
        with self._lock:
            self._flows.discard(flow)

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        with self._lock:
            r = self._live.get(request_id)
        if r is None or not r.abort(reason):
            return False
        self.counters.add(aborted=1)
        for c in self.workers.calls_of(request_id):
            c.cancel()               # the worker aborts it and frees its pages
        return True

    def stats(self) -> dict:
        """Counters, and every live worker's Info, asked in parallel with a short deadline
        (a worker that does not answer in time is left out)."""
        with self._lock:
            in_flight = sum(not r.is_final for r in self._live.values())
        workers = [w for w in self.workers.live_list()]
        asked = {self.workers.info_pool.submit(w.client.info, self.config.info_timeout_s): w
                 for w in workers}
        done, _ = futures.wait(asked, timeout=self.config.info_timeout_s + 0.5)
        found = {role: [] for role in ROLES}
        for f in done:
            if f.exception() is None:
                w = asked[f]
                found[w.role].append(dict(f.result(), address=w.address))
        return {"mesh": self.config.mesh, "in_flight": in_flight, **deployment_totals(found),
                **self.counters.snapshot(), "workers": found,
                "fingerprint": short(self.fingerprint), "versions": self.versions(),
                "problems": self.problems()}

    def shutdown(self) -> None:
        with self._lock:
            self._closed.set()
            live = list(self._live)
        for rid in live:
            self.abort(rid, "shutdown")
        with self._lock:
            flows = list(self._flows)
        futures.wait(flows, timeout=_SHUTDOWN_S)
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self.flow.close(), self._loop).result(_SHUTDOWN_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        if self._internal is not None:
            self._internal.stop(1).wait()
            self._rpc_pool.shutdown(wait=False)     # grpc leaves its threads running
        self.workers.close()
