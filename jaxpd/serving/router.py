"""The router: front door of a multi-process deployment.

It speaks the same `Frontend` interface as `LLM`, so the gRPC `Generation` service
(and `generate`/`stream`) run on it unchanged. Each request runs on one thread of a
bounded pool (`jaxpd-router-*`):

  1. pick the decode worker with the most free slots; open its `Decode` stream, which
     registers the request there;
  2. ask a prefill worker (least queued first) to prefill it with that decode worker as
     the KV destination; if every prefill worker fails, the decode worker prefills it
     itself (`Reprefill`);
  3. relay the decode stream's tokens into the request.
If the decode stream breaks (the worker died), the request is re-run on another decode
worker from prompt + tokens so far (same greedy output: recompute); with none left it
is aborted with a reason. Nothing is dropped silently, nothing waits forever: every
RPC has a deadline and the decode stream is cancelled on abort.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent import futures

import grpc

from jaxpd.errors import QueueFull
from jaxpd.frontend import Frontend
from jaxpd.request import Request
from jaxpd.stats import StatsCounter
from jaxpd.serving.role_rpc import ROUTER_SERVICE, RoleClient, unary_handler
from jaxpd.models.config import ModelConfig
from jaxpd.models.tokenizer import Tokenizer

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The limits the router validates requests against (the workers' own limits must
    be at least as large), and what it reports as its mesh."""
    max_model_len: int = 1024
    max_prompt_len: int | None = None
    max_queued: int = 1024
    rpc_timeout_s: float = 10.0
    prefill_timeout_s: float = 120.0
    dtype: str = "float32"
    page_size: int = 16

    def __post_init__(self):
        if self.max_prompt_len is None:
            object.__setattr__(self, "max_prompt_len", self.max_model_len - 1)
        for name in ("max_model_len", "max_prompt_len", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    mesh = "router"


class Router(Frontend):
    def __init__(self, model_dir: str, config: RouterConfig = RouterConfig(),
                 prefill: tuple[str, ...] = (), decode: tuple[str, ...] = ()):
        self.model_path = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        try:
            self.tokenizer = Tokenizer(model_dir)
        except FileNotFoundError:
            self.tokenizer = None
        self.config = config
        self._workers: dict[str, dict[str, RoleClient]] = {"prefill": {}, "decode": {}}
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}
        self._streams: dict[str, object] = {}
        self._ids = itertools.count()
        self._pool = futures.ThreadPoolExecutor(config.max_queued, thread_name_prefix="jaxpd-router")
        self._closed = False
        self.counters = StatsCounter(("finished", "aborted", "decode_failovers",
                                      "prefill_failovers", "decode_prefills"))
        for a in prefill:
            self.add_worker("prefill", a)
        for a in decode:
            self.add_worker("decode", a)

    # ---- workers ------------------------------------------------------------------

    def add_worker(self, role: str, address: str) -> None:
        if role not in self._workers:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        with self._lock:
            self._workers[role].setdefault(address, RoleClient(address))

    def handlers(self) -> grpc.GenericRpcHandler:
        """The `Register` RPC that workers call at start-up (served next to Generation)."""
        def Register(msg, context):
            try:
                self.add_worker(msg["role"], msg["address"])
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return {}
        return grpc.method_handlers_generic_handler(ROUTER_SERVICE,
                                                    {"Register": unary_handler(Register)})

    def ready(self) -> bool:
        """At least one prefill and one decode worker answer."""
        return bool(self._reachable("prefill")) and bool(self._reachable("decode"))

    def _reachable(self, role: str, exclude=()) -> list[tuple[dict, RoleClient]]:
        with self._lock:
            workers = [w for a, w in self._workers[role].items() if a not in exclude]
        found = []
        for w in workers:
            try:
                found.append((w.info(timeout=self.config.rpc_timeout_s), w))
            except grpc.RpcError:
                continue
        return found

    # ---- Frontend -----------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"rt-{next(self._ids)}"

    def submit(self, request: Request) -> Request:
        with self._lock:
            if self._closed:
                raise RuntimeError("router is shut down")
            for k in [k for k, r in self._live.items() if r.is_final]:
                del self._live[k]
            if len(self._live) >= self.config.max_queued:
                raise QueueFull(f"{len(self._live)} requests in flight "
                                f"(max_queued={self.config.max_queued})")
            self._live[request.request_id] = request
        self._pool.submit(self._run, request)
        return request

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        with self._lock:
            r = self._live.get(request_id)
            stream = self._streams.get(request_id)
        if r is None or not r.abort(reason):
            return False
        self.counters.add(aborted=1)
        if stream is not None:
            stream.cancel()          # the decode worker aborts it and frees its pages
        return True

    def stats(self) -> dict:
        workers = {role: [dict(info, address=w.address) for info, w in self._reachable(role)]
                   for role in ("prefill", "decode")}
        with self._lock:
            in_flight = sum(not r.is_final for r in self._live.values())
        return {"mesh": self.config.mesh, "in_flight": in_flight, **self.counters.snapshot(),
                "workers": workers}

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
        for rid in live:
            self.abort(rid, "shutdown")
        self._pool.shutdown(wait=True)
        with self._lock:
            for role in self._workers.values():
                for w in role.values():
                    w.close()

    # ---- one request --------------------------------------------------------------

    def _run(self, r: Request) -> None:
        try:
            self._run_until_final(r)
        except Exception as e:   # never leave a request hanging
            _log.exception("router failed on %s", r.request_id)
            if r.abort(f"failed: {e!r}"):
                self.counters.add(aborted=1)
        finally:
            with self._lock:
                self._streams.pop(r.request_id, None)

    def _run_until_final(self, r: Request) -> None:
        tried: set[str] = set()
        while not r.is_final:
            decoders = sorted(self._reachable("decode", exclude=tried),
                              key=lambda iw: -iw[0]["free_slots"])
            if not decoders:
                r.abort("failed: no decode worker reachable")
                self.counters.add(aborted=1)
                return
            info, decoder = decoders[0]
            stream = decoder.decode(r.to_wire())
            with self._lock:
                self._streams[r.request_id] = stream
            try:
                next(stream)                                   # registered there
                if not r.is_final:
                    self._prefill(r, decoder, info["kv_address"])
                for event in stream:
                    if self._relay(r, event):
                        return
            except grpc.RpcError as e:
                if r.is_final:
                    return                                     # we cancelled it
                _log.warning("decode worker %s lost %s (%s); re-running elsewhere",
                             decoder.address, r.request_id, e.code())
                tried.add(decoder.address)
                self.counters.add(decode_failovers=1)

    def _prefill(self, r: Request, decoder: RoleClient, kv_address: str) -> None:
        prefillers = sorted(self._reachable("prefill"), key=lambda iw: iw[0]["queue"])
        for _, p in prefillers:
            try:
                out = p.prefill(r.to_wire(), kv_address, timeout=self.config.prefill_timeout_s)
            except grpc.RpcError as e:
                _log.warning("prefill worker %s failed %s (%s)", p.address, r.request_id, e.code())
                self.counters.add(prefill_failovers=1)
                continue
            if out["status"] == "finished":                    # its first token ended it
                now = time.perf_counter()
                for t in out["token_ids"]:
                    r.append_token(t, now)
                self.counters.add(finished=1)
                decoder.abort(r.request_id, "finished at prefill", timeout=self.config.rpc_timeout_s)
            return
        # No prefill worker could: the decode worker prefills it on its own mesh.
        self.counters.add(decode_prefills=1)
        decoder.reprefill(r.request_id, timeout=self.config.rpc_timeout_s)

    def _relay(self, r: Request, event: dict) -> bool:
        """Apply one decode event; True once the request is final."""
        now = time.perf_counter()
        for t in event.get("token_ids", ()):
            if r.append_token(t, now):
                self.counters.add(finished=1)
                return True
        finish = event.get("finish")
        if finish == "abort":
            if r.abort(event.get("abort_reason") or "aborted by the decode worker"):
                self.counters.add(aborted=1)
            return True
        return r.is_final
