"""The router: front door of a multi-process deployment.

It speaks the same `Frontend` interface as `LLM`, so the gRPC `Generation` service
(and `generate`/`stream`) run on it unchanged. Workers reach it on a separate,
authenticated *internal* port (`listen`), never on the public one.

Workers. A worker registers on the internal port (`Register`) with its `WorkerInfo`
(model fingerprint, tokenizer, limits, page size, dtype, KV transport) and then
heartbeats the same call every `heartbeat_s` with its load. A worker whose tokenizer
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

Each request runs on one thread of a bounded pool (`jaxpd-router-*`; the steps are
`jaxpd.serving.router_flow`):
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
forever: every unary RPC has a deadline, a stream is watched, and every call is
cancelled on abort.

A worker changes role on `switch_role(address, role)` (issue 17; `role_switch`): the
router stops choosing it at once, the worker drains and rebuilds, and its next
heartbeat re-registers it in the new role at a new epoch; the old registration is
dropped like a lost worker (calls still open on it fail over), and every call names
the epoch the router knows, so a call meant for the old role is refused.

The `jaxpd-router-watch` thread expires leases, probes static workers and cancels
stalled streams; `stats()` asks every live worker for `Info` in parallel
(`jaxpd-router-info`) within `info_timeout_s`: a frozen worker costs that once.

SERVING (`ready()`): the router is not shut down and holds at least one live decode
worker (registered with the router's tokenizer and limits, its lease running; or static
and answering its probes). Prefill workers are optional: without one, the decode worker
prefills on its own mesh. Public health follows this at once, both ways, and says why
it cannot serve (`problems()`), e.g. prefill workers whose model no decode worker
serves.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from concurrent import futures

import grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.errors import QueueFull
from jaxpd.frontend import Frontend
from jaxpd.request import Request
from jaxpd.stats import StatsCounter
from jaxpd.serving.prefix_index import PrefixIndex, check_advertisement
from jaxpd.serving.router_config import RouterConfig, registration_mismatch
from jaxpd.serving.router_flow import RequestFlow
from jaxpd.serving.router_split import deployment_totals
from jaxpd.serving.role_rpc import (ROLES, ROUTER_SERVICE, RoleClient, WorkerInfo, check_load,
                                    router_identity, unary_handler)
from jaxpd.models.fingerprint import short
from jaxpd.models.source import model_config_and_tokenizer

_log = logging.getLogger(__name__)
__all__ = ["Router", "RouterConfig"]


@dataclasses.dataclass(eq=False)
class _Worker:
    role: str
    address: str
    client: RoleClient
    static: bool
    info: WorkerInfo | None = None      # None: a static worker not yet probed
    load: dict = dataclasses.field(default_factory=lambda: {"free_slots": 0, "free_pages": 0,
                                                            "queue": 0})
    seen: float = 0.0                   # time.monotonic() of the last heartbeat / probe
    live: bool = False
    probing: bool = False
    num_calls: int = 0                  # our calls open on it
    draining: bool = False              # switching roles: chosen for nothing new


@dataclasses.dataclass(eq=False)
class _Call:
    """One RPC the router has open on a worker for a request (cancellable)."""
    request_id: str
    worker: _Worker
    handle: object                      # a grpc stream or future: `.cancel()`
    last_seen: float | None = None      # a watched stream: when it last said something
    why: str | None = None              # set when the router cancels it itself
    destination: _Worker | None = None  # a Prefill's decode worker (where its KV goes)


class Router(RequestFlow, Frontend):
    def __init__(self, model_dir: str, config: RouterConfig = RouterConfig(),
                 prefill: tuple[str, ...] = (), decode: tuple[str, ...] = (),
                 auth: InternalAuth = NO_AUTH):
        self.model_path = model_dir
        self.model_config, self.tokenizer = model_config_and_tokenizer(model_dir)
        self.tokenizer_digest = router_identity(model_dir)
        # fingerprint -> order of first registration, for the versions workers serve
        self._versions: dict[str, int] = {}
        self._num_versions = 0
        self.config = config
        self.auth = auth
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._clients: dict[str, RoleClient] = {}   # by address, reused on re-registration
        self._pinned: dict[str, str] = {} if config.dtype == "auto" else {"dtype": config.dtype}
        self._live: dict[str, Request] = {}
        self._calls: set[_Call] = set()
        self._pool = futures.ThreadPoolExecutor(config.max_queued, thread_name_prefix="jaxpd-router")
        self._info_pool = futures.ThreadPoolExecutor(8, thread_name_prefix="jaxpd-router-info")
        self._internal: grpc.Server | None = None
        self._closed = threading.Event()
        self.counters = StatsCounter(("requests_submitted", "finished", "aborted",
                                      "decode_failovers",
                                      "prefill_failovers", "decode_prefills", "workers_dropped",
                                      "prefix_routed", "resplits", "split_vetoes"))
        self.prefix = PrefixIndex(config.page_size) if config.prefix_routing else None
        for a in prefill:
            self.add_static_worker("prefill", a)
        for a in decode:
            self.add_static_worker("decode", a)
        self._watcher = threading.Thread(target=self._watch, name="jaxpd-router-watch",
                                         daemon=True)
        self._watcher.start()

    # ---- workers ------------------------------------------------------------------

    def add_static_worker(self, role: str, address: str) -> None:
        """A worker named on the command line: probed with Info, used once it matches."""
        if role not in ROLES:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        with self._lock:
            if address not in self._workers:
                self._workers[address] = _Worker(role, address, self._client(address), static=True)

    def _client(self, address: str) -> RoleClient:
        """Under the lock."""
        if address not in self._clients:
            self._clients[address] = RoleClient(address, self.auth)
        return self._clients[address]

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
            prefix = msg.get("prefix")
            if prefix is not None:
                prefix = check_advertisement(prefix)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad registration: {e}")
        refusal = self.admit(info, load)
        if refusal is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        if self.prefix is None or prefix is None:
            return {"lease_s": self.config.lease_s}
        applied = self.prefix.advertise(info.address, prefix)
        return {"lease_s": self.config.lease_s, "resync": not applied}

    def admit(self, info: WorkerInfo, load: dict, static: bool = False) -> str | None:
        """Add or refresh a worker (a registration or a heartbeat); the reason it is
        refused, naming the field, or None."""
        with self._lock:
            refusal = registration_mismatch(
                info, self.tokenizer_digest, self.model_config.vocab_size, self.config,
                self._pinned)
            if refusal is not None:
                return refusal
            w = self._workers.get(info.address)
            if w is None or w.role != info.role:
                if w is not None:
                    self._lose(w, "re-registered with another role")
                w = self._workers[info.address] = _Worker(info.role, info.address,
                                                          self._client(info.address), static)
                _log.info("%s worker %s joined", info.role, info.address)
            elif w.info is not None and w.info.model != info.model:
                self._lose(w, "re-registered serving another model")
                w = self._workers[info.address] = _Worker(info.role, info.address,
                                                          self._client(info.address), static)
            if info.model not in self._versions:
                held = {x.info.model for x in self._workers.values() if x.info is not None}
                for gone in [m for m in self._versions if m not in held]:
                    del self._versions[gone]        # no worker serves it any more
                self._versions[info.model] = self._num_versions
                self._num_versions += 1
                _log.info("model version %s joined (%s worker %s)", short(info.model),
                          info.role, info.address)
            for field in ("dtype", "kv_transport"):
                self._pinned.setdefault(field, getattr(info, field))
            w.info, w.load, w.seen, w.live = info, load, time.monotonic(), True
        return None

    def _live_workers(self, role: str, exclude=(), model: str | None = None) -> list[_Worker]:
        """Live workers of `role` the router may choose, of fingerprint `model` if given."""
        with self._lock:
            return [w for w in self._workers.values()
                    if w.live and not w.draining and w.role == role and w.address not in exclude
                    and (model is None or w.info.model == model)]

    def _live_models(self) -> dict[str, set[str]]:
        """fingerprint -> the roles it has live and choosable."""
        models: dict[str, set[str]] = {}
        with self._lock:
            for w in self._workers.values():
                if w.live and not w.draining and w.info is not None:
                    models.setdefault(w.info.model, set()).add(w.role)
        return models

    def serving_model(self) -> str | None:
        """The fingerprint new requests go to: the newest version with a live decode and
        a live prefill worker, else the newest with a live decode worker; None if none."""
        models = self._live_models()
        with self._lock:
            order = dict(self._versions)
        servable = [m for m, roles in models.items() if "decode" in roles]
        paired = [m for m in servable if "prefill" in models[m]]
        for choice in (paired, servable):
            if choice:
                return max(choice, key=lambda m: order.get(m, -1))
        return None

    @property
    def fingerprint(self) -> str:
        """The serving model's fingerprint ("" while none is servable)."""
        return self.serving_model() or ""

    def problems(self) -> list[str]:
        """Why some live workers cannot serve, one line each: no decode worker at all,
        or a model version whose prefill workers have no decode worker of the same
        fingerprint (their KV would be meaningless to any other)."""
        models = self._live_models()
        found = [f"prefill workers of model {short(m)} have no decode worker serving "
                 f"the same model (fingerprint), so they are never used"
                 for m, roles in sorted(models.items()) if roles == {"prefill"}]
        if not any("decode" in roles for roles in models.values()):
            found.insert(0, "no live decode worker")
        return found

    def versions(self) -> list[dict]:
        """Every live model version, newest first: its short fingerprint and live
        workers per role."""
        with self._lock:
            order = dict(self._versions)
            counts: dict[str, dict[str, int]] = {}
            for w in self._workers.values():
                if w.live and w.info is not None:
                    c = counts.setdefault(w.info.model, {role: 0 for role in ROLES})
                    c[w.role] += 1
        return [{"model": short(m), **c} for m, c in
                sorted(counts.items(), key=lambda mc: -order.get(mc[0], -1))]

    def switch_role(self, address: str, role: str, timeout_s: float = 600.0) -> dict:
        """Have the worker at `address` become a `role` worker (`role_switch`): nothing
        new goes to it from now on; it drains, rebuilds and answers its new epoch
        ({"role", "epoch"}); its next heartbeat re-registers it in the new role.
        ValueError for no such live worker or role; RuntimeError if it failed."""
        with self._lock:
            w = self._workers.get(address)
            if w is None or not w.live or w.info is None:
                raise ValueError(f"no live worker at {address!r}")
            if role not in ROLES or role == w.role:
                raise ValueError(f"role must be the other of {ROLES}, got {role!r} for the "
                                 f"{w.role} worker {address}")
            w.draining = True
        try:
            answer = w.client.switch_role(role, w.info.epoch, timeout=timeout_s)
        except grpc.RpcError as e:
            with self._lock:
                w.draining = False
            raise RuntimeError(f"the {w.role} worker {address} did not switch to {role}: "
                               f"{e.code()}: {e.details()}") from None
        self.counters.add(resplits=1)
        return answer

    def live_workers(self) -> dict[str, str]:
        """address -> role of every live worker."""
        with self._lock:
            return {a: w.role for a, w in self._workers.items() if w.live}

    def worker_loads(self) -> list[dict]:
        """Each live worker the router may choose (not draining): role, address, calls
        open on it, and its last heartbeat's load (`router_split`)."""
        with self._lock:
            return [{"role": w.role, "address": w.address, "num_calls": w.num_calls, **w.load}
                    for w in self._workers.values() if w.live and not w.draining]

    def ready(self) -> bool:
        """SERVING: see the module docstring (at least one live decode worker)."""
        return not self._closed.is_set() and self.serving_model() is not None

    # ---- liveness -----------------------------------------------------------------

    def _watch(self) -> None:
        tick = min(0.1, self.config.heartbeat_s / 4)
        next_probe = 0.0
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                workers = list(self._workers.values())
                calls = list(self._calls)
            for w in workers:
                if w.live and now - w.seen > self.config.lease_s:
                    self._expire(w)
            if now >= next_probe:
                next_probe = now + self.config.heartbeat_s
                for w in workers:
                    if w.static and not w.probing:
                        w.probing = True
                        self._info_pool.submit(self._probe, w)
            for c in calls:
                if c.last_seen is not None and now - c.last_seen > self.config.stall_timeout_s:
                    self._cancel(c, f"sent nothing for {self.config.stall_timeout_s:g} s")

    def _expire(self, w: _Worker) -> None:
        with self._lock:
            if not w.live or time.monotonic() - w.seen <= self.config.lease_s:
                return                              # a heartbeat came meanwhile
            if w.static:
                w.live = False
            elif self._workers.get(w.address) is w:
                del self._workers[w.address]
            self._lose(w, f"no heartbeat for {self.config.lease_s:g} s")

    def _lose(self, w: _Worker, why: str) -> None:
        """Under the lock: `w` is gone; cancel our calls on it (they fail over)."""
        w.live = False
        self.counters.add(workers_dropped=1)
        if self.prefix is not None:
            self.prefix.forget(w.address)
        _log.warning("%s worker %s dropped: %s", w.role, w.address, why)
        # Its own calls, and Prefills whose KV was on its way to it (the prefill worker
        # would otherwise wait out its send timeout on a frozen destination).
        for c in [c for c in self._calls if c.worker is w or c.destination is w]:
            self._cancel(c, f"its worker was dropped ({why})")

    def _probe(self, w: _Worker) -> None:
        try:
            reply = w.client.info(timeout=self.config.info_timeout_s)
            info = WorkerInfo.from_wire({**reply, "address": w.address})
            load = check_load(reply)
        except (grpc.RpcError, ValueError, KeyError, TypeError):
            return
        finally:
            w.probing = False
        refusal = self.admit(info, load, static=True)
        if refusal is not None and w.info is None:
            _log.error("not using %s", refusal)
            w.info = info                         # logged once; never live

    # ---- calls --------------------------------------------------------------------

    def _track(self, r: Request, w: _Worker, handle, watched: bool,
               destination: _Worker | None = None) -> _Call:
        c = _Call(r.request_id, w, handle, time.monotonic() if watched else None,
                  destination=destination)
        with self._lock:
            self._calls.add(c)
            w.num_calls += 1
        return c

    def _untrack(self, c: _Call) -> None:
        with self._lock:
            if c in self._calls:
                self._calls.discard(c)
                c.worker.num_calls -= 1

    @staticmethod
    def _cancel(c: _Call, why: str) -> None:
        if c.why is None:
            c.why = why
        c.handle.cancel()

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
        self.counters.add(requests_submitted=1)
        self._pool.submit(self._run, request)
        return request

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        with self._lock:
            r = self._live.get(request_id)
            calls = [c for c in self._calls if c.request_id == request_id]
        if r is None or not r.abort(reason):
            return False
        self.counters.add(aborted=1)
        for c in calls:
            c.handle.cancel()        # the worker aborts it and frees its pages
        return True

    def stats(self) -> dict:
        """Counters, and every live worker's Info, asked in parallel with a short deadline
        (a worker that does not answer in time is left out)."""
        with self._lock:
            workers = [w for w in self._workers.values() if w.live]
            in_flight = sum(not r.is_final for r in self._live.values())
        asked = {self._info_pool.submit(w.client.info, self.config.info_timeout_s): w
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
        self._pool.shutdown(wait=True)
        self._watcher.join(timeout=5)
        if self._internal is not None:
            self._internal.stop(1).wait()
            self._rpc_pool.shutdown(wait=False)     # grpc leaves its threads running
        self._info_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()

    # ---- one request --------------------------------------------------------------
