"""The internal RPCs between the router and single-role worker processes.

No protobuf codegen (these never face users): msgpack bodies over gRPC generic
handlers, like the transfer control plane. Every body carries `wire_version`. Plain
Python (msgpack, grpc, no jax): the router process imports this.

  Info      unary     -> the worker's identity (`WorkerInfo` fields) and its load
  Prefill   unary     request (wire form) + destination -> "handed_off" | "finished"
  Decode    stream    request (wire form) [+ local] -> {"registered"}, then token
                      events (with each token's log-probabilities when the request
                      asks for them), and {"alive"} after each second without one
  Reprefill unary     request_id -> the decode worker prefills it itself
  Abort     unary     request_id, reason
  Migrate   unary     request_id + destination -> a draining decode worker sends the
                      request's held KV to that decode worker (`serving.migration`);
                      its Decode stream ended with {"migrating"}
  SwitchRole unary    role -> the worker drains, rebuilds its engine for that role on
                      the same devices, and answers its new epoch (`role_switch`)
  Register  unary     (served by the router's internal port) `WorkerInfo` fields +
                      address + load [+ draining: why it takes no new request],
                      every `heartbeat_s` -> {"lease_s"} [+ a draining decode
                      worker's "decode_peers": others its requests could move to]

Every router -> worker call but Info names the worker's `epoch` as the router knows
it (`WorkerInfo.epoch`, 1 at start, one more per role switch); a worker refuses a
call for another epoch (FAILED_PRECONDITION), so nothing meant for its old role is
applied to its new one. All of them travel on the internal plane only: servers take `InternalAuth`'s
interceptors and credentials, clients its channel. Bodies are decoded here, with size
limits, so a malformed one is INVALID_ARGUMENT and a body of another wire version
FAILED_PRECONDITION, before any handler runs; a handler refuses a call by raising
`Refusal`.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator

import grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.request import TokenLogprobs, logprobs_from_wire
from jaxpd.transfer.wire import (WIRE_VERSION, MalformedMessage, WireVersionError, pack,
                                 unpack, unpack_checked)

ROLE_SERVICE = "jaxpd.internal.Worker"
ROUTER_SERVICE = "jaxpd.internal.Router"
ROLES = ("prefill", "decode")
KV_TRANSPORTS = ("transfer_server", "grpc")
MAX_ADDRESS_LEN = 256
MAX_REASON_LEN = 256

# The router -> worker channel pings an idle connection so a half-open one (a frozen
# or unplugged peer) is noticed; worker servers allow pings that often.
CLIENT_KEEPALIVE = (("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_pings_without_data", 0))
SERVER_KEEPALIVE = (("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000))


class Refusal(Exception):
    """Answer the call with `code` and `message`: what a handler, or a check it calls,
    raises to refuse it (the same for coroutine and blocking handlers)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def unary_handler(fn):
    return grpc.unary_unary_rpc_method_handler(_checked(fn), response_serializer=pack)


def stream_handler(fn):
    return grpc.unary_stream_rpc_method_handler(_checked(fn), response_serializer=pack)


def _unpacked(data: bytes, name: str) -> dict:
    try:
        return unpack_checked(data, name)
    except WireVersionError as e:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    except MalformedMessage as e:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _checked(fn):
    """`fn(message, context)` taking the body's bytes: decoded first (`_unpacked`), and
    a `Refusal` from either step answers the call. `fn` may be a plain function or
    generator (grpc runs it on the server's thread pool), or, on a `grpc.aio` server, a
    coroutine function or an async generator (run on the server's event loop)."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):
        async def serve_stream(data: bytes, context: grpc.aio.ServicerContext):
            try:
                async for reply in fn(_unpacked(data, name), context):
                    yield reply
            except Refusal as e:
                await context.abort(e.code, e.message)
        return serve_stream
    if inspect.iscoroutinefunction(fn):
        async def serve_async(data: bytes, context: grpc.aio.ServicerContext):
            try:
                return await fn(_unpacked(data, name), context)
            except Refusal as e:
                await context.abort(e.code, e.message)
        return serve_async
    if inspect.isgeneratorfunction(fn):
        def serve_generator(data: bytes, context: grpc.ServicerContext):
            try:
                yield from fn(_unpacked(data, name), context)
            except Refusal as e:
                context.abort(e.code, e.message)
        return serve_generator

    def serve(data: bytes, context: grpc.ServicerContext):
        try:
            return fn(_unpacked(data, name), context)
        except Refusal as e:
            context.abort(e.code, e.message)
    return serve


# ---- what a worker is ---------------------------------------------------------------

def router_identity(model_path: str) -> str:
    """What the router itself serves of the checkpoint at `model_path`: its tokenizer
    (`models.fingerprint.tokenizer_digest`). A worker must match it, since the router
    turns text into ids for every worker; its weights may differ (another version)."""
    from jaxpd.models.fingerprint import tokenizer_digest
    from jaxpd.models.source import checkpoint_path
    return tokenizer_digest(checkpoint_path(model_path))


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself at registration (and in Info): the router
    refuses one whose tokenizer or limits differ from its own, and pairs a prefill
    and a decode worker only when their `model` fingerprints are equal."""
    role: str
    address: str
    kv_address: str
    model: str                # its engine's `models.fingerprint` (64 hex digits)
    tokenizer: str            # `router_identity()` of its checkpoint
    max_model_len: int
    max_prompt_len: int
    vocab_size: int
    page_size: int
    dtype: str
    kv_transport: str
    epoch: int = 1            # one more per role switch (`role_switch`)

    @classmethod
    def from_wire(cls, d: dict) -> "WorkerInfo":
        """Every field checked for type and size; ValueError naming the field."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = d.get(f.name, f.default)
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
                    raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
            elif not isinstance(value, str) or len(value) > MAX_ADDRESS_LEN or (
                    not value.isprintable()):
                raise ValueError(f"{f.name} must be a printable string of at most "
                                 f"{MAX_ADDRESS_LEN} characters")
            kwargs[f.name] = value
        info = cls(**kwargs)
        if info.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {info.role!r}")
        if info.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, "
                             f"got {info.kv_transport!r}")
        if not info.address:
            raise ValueError("address is empty")
        from jaxpd.models.fingerprint import is_fingerprint
        for name in ("model", "tokenizer"):
            if not is_fingerprint(getattr(info, name)):
                raise ValueError(f"{name} must be a fingerprint: 64 lower-case hex digits")
        return info

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


def check_load(d: Any) -> dict[str, int]:
    """A heartbeat's load: free slots, free pages, queued requests (ints >= 0)."""
    if not isinstance(d, dict):
        raise ValueError(f"load must be a map, got {type(d).__name__}")
    load = {}
    for name in ("free_slots", "free_pages", "queue"):
        value = d.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise ValueError(f"load.{name} must be a non-negative integer, got {value!r}")
        load[name] = value
    return load


def check_move_failure(value: Any) -> str:
    """A Decode event's "migration_failed": why the migration that was to bring the
    request's KV failed (printable text of at most `MAX_REASON_LEN` characters)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REASON_LEN or \
            not value.isprintable():
        raise ValueError(f"migration_failed must be printable text of at most "
                         f"{MAX_REASON_LEN} characters")
    return value


def check_draining(value: Any) -> str | None:
    """A heartbeat's "draining": None, or why the worker takes no new request
    (printable text of at most `MAX_REASON_LEN` characters)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REASON_LEN or \
            not value.isprintable():
        raise ValueError(f"draining must be printable text of at most {MAX_REASON_LEN} "
                         f"characters")
    return value


def check_tokens(answer: Any, vocab_size: int, logprobs: int | None
                 ) -> list[tuple[int, TokenLogprobs | None]]:
    """A Decode event's or a finished Prefill's "token_ids", paired with their
    "logprobs" (when the request asks for `logprobs` per token; None otherwise). The
    router checks them as a peer's word: ValueError naming the field."""
    if not isinstance(answer, dict):
        raise ValueError(f"an answer must be a map, got {type(answer).__name__}")
    ids = answer.get("token_ids", [])
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                        or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"token_ids must be ids in the vocabulary [0, {vocab_size})")
    if logprobs is None or not ids:         # ({"alive"} and the finish carry none)
        return [(t, None) for t in ids]
    return list(zip(ids, logprobs_from_wire(answer.get("logprobs"), len(ids), logprobs)))


# ---- clients ------------------------------------------------------------------------

def _caller(channel):
    """(kind, method) -> the channel's callable for the role service's `method`."""
    return lambda kind, name: getattr(channel, kind)(
        f"/{ROLE_SERVICE}/{name}", request_serializer=pack, response_deserializer=unpack)


def _request_calls(call) -> tuple:
    """The calls that run a request: Prefill, Decode (a stream), Reprefill, Abort."""
    return (call("unary_unary", "Prefill"), call("unary_stream", "Decode"),
            call("unary_unary", "Reprefill"), call("unary_unary", "Abort"))


class RoleClient:
    """The router's handle on one worker process."""

    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address = address
        self._channel = auth.channel(address, options=CLIENT_KEEPALIVE)
        call = _caller(self._channel)
        self._info = call("unary_unary", "Info")
        self._prefill, self._decode, self._reprefill, self._abort = _request_calls(call)
        self._switch_role = call("unary_unary", "SwitchRole")

    def info(self, timeout: float) -> dict:
        return self._info(_msg(), timeout=timeout)

    def prefill(self, request: dict, destination: str, timeout: float, epoch: int = 1
                ) -> grpc.Future:
        """A cancellable call: `.result()` is {"status": ...}."""
        return self._prefill.future(_msg(request=request, destination=destination,
                                         epoch=epoch), timeout=timeout)

    def decode(self, request: dict, local: bool = False, epoch: int = 1) -> Iterator[dict]:
        """A cancellable stream (`.cancel()`): {"registered": True} first, then events."""
        return self._decode(_msg(request=request, local=local, epoch=epoch))

    def reprefill(self, request_id: str, timeout: float, epoch: int = 1) -> bool:
        return bool(self._reprefill(_msg(request_id=request_id, epoch=epoch),
                                    timeout=timeout)["ok"])

    def abort(self, request_id: str, reason: str, timeout: float, epoch: int = 1) -> bool:
        return bool(self._abort(_msg(request_id=request_id, reason=reason, epoch=epoch),
                                timeout=timeout)["aborted"])

    def switch_role(self, role: str, epoch: int, timeout: float) -> dict:
        """{"role", "epoch"} once the worker serves `role` (draining and rebuilding
        take up to `timeout`)."""
        return self._switch_role(_msg(role=role, epoch=epoch), timeout=timeout)

    def close(self) -> None:
        self._channel.close()


class AsyncRoleClient:
    """The router's asyncio handle on one worker, for its event loop (make it there):
    the calls that run a request. Each call can be cancelled (`.cancel()`, on the
    loop), and awaiting a cancelled one raises `asyncio.CancelledError`."""

    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address = address
        self._channel = auth.aio_channel(address, options=CLIENT_KEEPALIVE)
        self._metadata = auth.metadata
        call = _caller(self._channel)
        self._prefill, self._decode, self._reprefill, self._abort = _request_calls(call)
        self._migrate = call("unary_unary", "Migrate")

    def prefill(self, request: dict, destination: str, timeout: float | None, epoch: int = 1
                ) -> grpc.aio.UnaryUnaryCall:
        """Awaiting it gives {"status": ...} (`timeout` None: no deadline)."""
        return self._prefill(_msg(request=request, destination=destination, epoch=epoch),
                             timeout=timeout, metadata=self._metadata)

    def decode(self, request: dict, local: bool = False, epoch: int = 1
               ) -> grpc.aio.UnaryStreamCall:
        """`await .read()`: {"registered": True} first, then events, then grpc.aio.EOF."""
        return self._decode(_msg(request=request, local=local, epoch=epoch),
                            metadata=self._metadata)

    async def reprefill(self, request_id: str, timeout: float, epoch: int = 1) -> bool:
        answer = await self._reprefill(_msg(request_id=request_id, epoch=epoch),
                                       timeout=timeout, metadata=self._metadata)
        return bool(answer["ok"])

    async def abort(self, request_id: str, reason: str, timeout: float, epoch: int = 1) -> bool:
        answer = await self._abort(_msg(request_id=request_id, reason=reason, epoch=epoch),
                                   timeout=timeout, metadata=self._metadata)
        return bool(answer["aborted"])

    def migrate(self, request_id: str, destination: str, timeout: float | None,
                epoch: int = 1) -> grpc.aio.UnaryUnaryCall:
        """Have this (draining) decode worker send `request_id`'s KV to the decode
        worker at KV address `destination`: awaiting the call raises
        grpc.aio.AioRpcError saying why not."""
        return self._migrate(_msg(request_id=request_id, destination=destination,
                                  epoch=epoch), timeout=timeout, metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()


def register(router_address: str, info: WorkerInfo, load: dict, auth: InternalAuth,
             timeout: float, prefix: dict | None = None, draining: str | None = None) -> dict:
    """Announce (or re-announce: the heartbeat) a worker to the router, with what its
    prefix caches hold (`CacheJournal.take`) when it has them, and why it takes no new
    request (`draining`) while it drains. Raises grpc.RpcError while the router is not
    up, or when it refuses this worker."""
    return send_register(router_address, register_body(info, load, prefix, draining), auth,
                         timeout)


def register_body(info: WorkerInfo, load: dict, prefix: dict | None = None,
                  draining: str | None = None) -> dict:
    """A Register call's body (see `register`)."""
    fields = {} if prefix is None else {"prefix": prefix}
    if draining is not None:
        fields["draining"] = draining
    return _msg(**info.to_wire(), load=load, **fields)


def send_register(router_address: str, body: dict, auth: InternalAuth, timeout: float) -> dict:
    """Send a Register `body` (`register_body`) to the router; its answer."""
    with auth.channel(router_address) as channel:
        call = channel.unary_unary(f"/{ROUTER_SERVICE}/Register", request_serializer=pack,
                                   response_deserializer=unpack)
        return call(body, timeout=timeout)


def _msg(**fields) -> dict:
    return {"wire_version": WIRE_VERSION, **fields}
