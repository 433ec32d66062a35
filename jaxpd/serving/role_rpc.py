"""The internal RPCs between the router and single-role worker processes.

No protobuf codegen (these never face users): msgpack bodies over gRPC generic
handlers, like the transfer control plane. Every body carries `wire_version`. Plain
Python (`jaxpd.transfer.wire`, no jax): the router process imports this.

  Info      unary     -> role, mesh, kv_address, free slots/pages, queue depth
  Prefill   unary     request (wire form) + destination -> "handed_off" | "finished"
  Decode    stream    request (wire form) [+ local] -> {"registered"}, then token events
  Reprefill unary     request_id -> the decode worker prefills it itself
  Abort     unary     request_id, reason
  Register  unary     (served by the router) role, address -> {}
"""
from __future__ import annotations

from typing import Any, Iterator

import grpc

from jaxpd.transfer.wire import WIRE_VERSION, check_wire_version, pack, unpack

ROLE_SERVICE = "jaxpd.internal.Worker"
ROUTER_SERVICE = "jaxpd.internal.Router"


def unary_handler(fn):
    return grpc.unary_unary_rpc_method_handler(_checked(fn), request_deserializer=unpack,
                                               response_serializer=pack)


def stream_handler(fn):
    return grpc.unary_stream_rpc_method_handler(_checked(fn), request_deserializer=unpack,
                                                response_serializer=pack)


def _checked(fn):
    def serve(message: dict[str, Any], context: grpc.ServicerContext):
        try:
            check_wire_version(message.get("wire_version"), fn.__name__)
        except Exception as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return fn(message, context)
    return serve


class RoleClient:
    """The router's handle on one worker process."""

    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.insecure_channel(address)
        call = lambda kind, name: getattr(self._channel, kind)(
            f"/{ROLE_SERVICE}/{name}", request_serializer=pack, response_deserializer=unpack)
        self._info = call("unary_unary", "Info")
        self._prefill = call("unary_unary", "Prefill")
        self._decode = call("unary_stream", "Decode")
        self._reprefill = call("unary_unary", "Reprefill")
        self._abort = call("unary_unary", "Abort")

    def info(self, timeout: float) -> dict:
        return self._info(_msg(), timeout=timeout)

    def prefill(self, request: dict, destination: str, timeout: float) -> dict:
        return self._prefill(_msg(request=request, destination=destination), timeout=timeout)

    def decode(self, request: dict, local: bool = False) -> Iterator[dict]:
        """A cancellable stream (`.cancel()`): {"registered": True} first, then events."""
        return self._decode(_msg(request=request, local=local))

    def reprefill(self, request_id: str, timeout: float) -> bool:
        return bool(self._reprefill(_msg(request_id=request_id), timeout=timeout)["ok"])

    def abort(self, request_id: str, reason: str, timeout: float) -> bool:
        return bool(self._abort(_msg(request_id=request_id, reason=reason), timeout=timeout)["aborted"])

    def close(self) -> None:
        self._channel.close()


def register(router_address: str, role: str, address: str, timeout: float) -> None:
    """Announce a worker to the router (raises grpc.RpcError while it is not up)."""
    with grpc.insecure_channel(router_address) as channel:
        call = channel.unary_unary(f"/{ROUTER_SERVICE}/Register", request_serializer=pack,
                                   response_deserializer=unpack)
        call(_msg(role=role, address=address), timeout=timeout)


def _msg(**fields) -> dict:
    return {"wire_version": WIRE_VERSION, **fields}
