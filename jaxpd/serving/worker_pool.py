"""The router's workers: who they are, whether they live, and the calls open on them.

`WorkerPool` keeps every worker the router knows (registered on its internal port, or
static and probed with `Info`), checks each registration against the router's own
identity and limits (`registration_mismatch`), tracks the model versions they serve,
and answers which are live and choosable. It also holds the calls the router has open
on each worker (`track`), so that losing a worker cancels exactly its calls.

One thread, `jaxpd-router-watch`, expires leases, probes static workers (on the
`jaxpd-router-info` threads) and cancels calls whose stream has been silent for
`stall_timeout_s`. A call's `cancel` may run on any thread: it hands the cancel to the
event loop the call belongs to.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from concurrent import futures

import grpc

from jaxpd.auth import InternalAuth
from jaxpd.models.fingerprint import short
from jaxpd.serving.prefix_index import PrefixIndex
from jaxpd.serving.role_rpc import ROLES, RoleClient, WorkerInfo, check_draining, check_load
from jaxpd.serving.router_config import RouterConfig, registration_mismatch
from jaxpd.stats import StatsCounter

_log = logging.getLogger("jaxpd.serving.router")


@dataclasses.dataclass(eq=False)
class Worker:
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
    says_draining: str | None = None    # its last heartbeat's reason to take nothing new

    @property
    def choosable(self) -> bool:
        """Live, and neither the router nor the worker itself drains it."""
        return self.live and not self.draining and self.says_draining is None


@dataclasses.dataclass(eq=False)
class Call:
    """One RPC the router has open on a worker for a request (cancellable from any
    thread: `handle.cancel()` runs on `loop`, the loop the call was made on)."""
    request_id: str
    worker: Worker
    handle: object                      # a grpc.aio call: `.cancel()`
    loop: asyncio.AbstractEventLoop
    last_seen: float | None = None      # a watched stream: when it last said something
    why: str | None = None              # set when the router cancels it itself
    destination: Worker | None = None   # a Prefill's decode worker (where its KV goes)

    def cancel(self, why: str | None = None) -> None:
        if self.why is None:
            self.why = why
        with contextlib.suppress(RuntimeError):     # the loop is closed: nothing runs
            self.loop.call_soon_threadsafe(self.handle.cancel)


class WorkerPool:
    """The workers of one router (see the module docstring). `tokenizer_digest` and
    `vocab_size` are the router's own: a worker must match them."""

    def __init__(self, config: RouterConfig, tokenizer_digest: str, vocab_size: int,
                 auth: InternalAuth, counters: StatsCounter, prefix: PrefixIndex | None):
        self.config, self.auth, self.counters, self.prefix = config, auth, counters, prefix
        self.tokenizer_digest, self.vocab_size = tokenizer_digest, vocab_size
        # fingerprint -> order of first registration, for the versions workers serve
        self._versions: dict[str, int] = {}
        self._num_versions = 0
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}
        self._clients: dict[str, RoleClient] = {}   # by address, reused on re-registration
        self._pinned: dict[str, str] = {} if config.dtype == "auto" else {"dtype": config.dtype}
        self._calls: set[Call] = set()
        self.info_pool = futures.ThreadPoolExecutor(8, thread_name_prefix="jaxpd-router-info")
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="jaxpd-router-watch",
                                         daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._closed.set()
        self._watcher.join(timeout=5)
        self.info_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()

    def add_static(self, role: str, address: str) -> None:
        """A worker named on the command line: probed with Info, used once it matches."""
        if role not in ROLES:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        with self._lock:
            if address not in self._workers:
                self._workers[address] = Worker(role, address, self._client(address), static=True)

    def _client(self, address: str) -> RoleClient:
        """Under the lock."""
        if address not in self._clients:
            self._clients[address] = RoleClient(address, self.auth)
        return self._clients[address]

    def get(self, address: str) -> Worker | None:
        with self._lock:
            return self._workers.get(address)

    def set_draining(self, w: Worker, draining: bool) -> None:
        with self._lock:
            w.draining = draining

    def admit(self, info: WorkerInfo, load: dict, static: bool = False,
              draining: str | None = None) -> str | None:
        """Add or refresh a worker (a registration or a heartbeat, `draining` its reason
        to take no new request); the reason it is refused, naming the field, or None."""
        with self._lock:
            refusal = registration_mismatch(
                info, self.tokenizer_digest, self.vocab_size, self.config, self._pinned)
            if refusal is not None:
                return refusal
            w = self._workers.get(info.address)
            if w is None or w.role != info.role:
                if w is not None:
                    self.lose(w, "re-registered with another role")
                w = self._workers[info.address] = Worker(info.role, info.address,
                                                          self._client(info.address), static)
                _log.info("%s worker %s joined", info.role, info.address)
            elif w.info is not None and w.info.model != info.model:
                self.lose(w, "re-registered serving another model")
                w = self._workers[info.address] = Worker(info.role, info.address,
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
            if draining is not None and w.says_draining is None:
                _log.info("%s worker %s drains (%s): chosen for nothing new", info.role,
                          info.address, draining)
            w.info, w.load, w.seen, w.live = info, load, time.monotonic(), True
            w.says_draining = draining
        return None

    def live(self, role: str, exclude=(), model: str | None = None) -> list[Worker]:
        """Live workers of `role` the router may choose, of fingerprint `model` if given."""
        with self._lock:
            return [w for w in self._workers.values()
                    if w.choosable and w.role == role and w.address not in exclude
                    and (model is None or w.info.model == model)]

    def decode_peers(self, address: str, model: str) -> int:
        """Decode workers of fingerprint `model` but the one at `address` that the router
        may choose: where a draining decode worker's requests could move."""
        return len(self.live("decode", (address,), model))

    def live_models(self) -> dict[str, set[str]]:
        """fingerprint -> the roles it has live and choosable."""
        models: dict[str, set[str]] = {}
        with self._lock:
            for w in self._workers.values():
                if w.choosable and w.info is not None:
                    models.setdefault(w.info.model, set()).add(w.role)
        return models

    def serving_model(self) -> str | None:
        """The fingerprint new requests go to: the newest version with a live decode and
        a live prefill worker, else the newest with a live decode worker; None if none."""
        models = self.live_models()
        with self._lock:
            order = dict(self._versions)
        servable = [m for m, roles in models.items() if "decode" in roles]
        paired = [m for m in servable if "prefill" in models[m]]
        for choice in (paired, servable):
            if choice:
                return max(choice, key=lambda m: order.get(m, -1))
        return None

    def problems(self) -> list[str]:
        """Why some live workers cannot serve, one line each: no decode worker at all,
        or a model version whose prefill workers have no decode worker of the same
        fingerprint (their KV would be meaningless to any other)."""
        models = self.live_models()
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

    def live_list(self) -> list[Worker]:
        """Every live worker, draining ones too."""
        with self._lock:
            return [w for w in self._workers.values() if w.live]

    def live_workers(self) -> dict[str, str]:
        """address -> role of every live worker."""
        with self._lock:
            return {a: w.role for a, w in self._workers.items() if w.live}

    def worker_loads(self) -> list[dict]:
        """Each live worker the router may choose (not draining): role, address, calls
        open on it, and its last heartbeat's load (`router_split`)."""
        with self._lock:
            return [{"role": w.role, "address": w.address, "num_calls": w.num_calls, **w.load}
                    for w in self._workers.values() if w.choosable]

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
                        self.info_pool.submit(self._probe, w)
            for c in calls:
                if c.last_seen is not None and now - c.last_seen > self.config.stall_timeout_s:
                    c.cancel(f"sent nothing for {self.config.stall_timeout_s:g} s")

    def _expire(self, w: Worker) -> None:
        with self._lock:
            if not w.live or time.monotonic() - w.seen <= self.config.lease_s:
                return                              # a heartbeat came meanwhile
            if w.static:
                w.live = False
            elif self._workers.get(w.address) is w:
                del self._workers[w.address]
            self.lose(w, f"no heartbeat for {self.config.lease_s:g} s")

    def lose(self, w: Worker, why: str) -> None:
        """Under the lock: `w` is gone; cancel our calls on it (they fail over)."""
        w.live = False
        self.counters.add(workers_dropped=1)
        if self.prefix is not None:
            self.prefix.forget(w.address)
        _log.warning("%s worker %s dropped: %s", w.role, w.address, why)
        # Its own calls, and Prefills whose KV was on its way to it (the prefill worker
        # would otherwise wait out its send timeout on a frozen destination).
        for c in [c for c in self._calls if c.worker is w or c.destination is w]:
            c.cancel(f"its worker was dropped ({why})")

    def _probe(self, w: Worker) -> None:
        try:
            reply = w.client.info(timeout=self.config.info_timeout_s)
            info = WorkerInfo.from_wire({**reply, "address": w.address})
            load = check_load(reply)
            draining = check_draining(reply.get("draining"))
        except (grpc.RpcError, ValueError, KeyError, TypeError):
            return
        finally:
            w.probing = False
        refusal = self.admit(info, load, static=True, draining=draining)
        if refusal is not None and w.info is None:
            _log.error("not using %s", refusal)
            w.info = info                         # logged once; never live

    # ---- calls --------------------------------------------------------------------

    def track(self, request_id: str, w: Worker, handle, loop: asyncio.AbstractEventLoop,
              watched: bool, destination: Worker | None = None) -> Call:
        """Count a call open on `w` (`watched`: a stream whose silence is watched)."""
        c = Call(request_id, w, handle, loop, time.monotonic() if watched else None,
                 destination=destination)
        with self._lock:
            self._calls.add(c)
            w.num_calls += 1
        return c

    def untrack(self, c: Call) -> None:
        with self._lock:
            if c in self._calls:
                self._calls.discard(c)
                c.worker.num_calls -= 1

    def calls_of(self, request_id: str) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if c.request_id == request_id]
