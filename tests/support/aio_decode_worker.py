"""A fake decode worker on a `grpc.aio` server (its own event loop thread), for router
tests with hundreds of streams open at once: each Decode stream registers, waits for
`gate`, then streams token 7 until max_tokens. It counts the streams open and the ones
the router cancelled."""
from __future__ import annotations

import asyncio
import threading

import grpc

from jaxpd.auth import NO_AUTH
from jaxpd.models.config import ModelConfig
from jaxpd.default_model import default_model_dir
from jaxpd.serving.role_rpc import ROLE_SERVICE, WorkerInfo, register, router_identity
from jaxpd.transfer.wire import pack, unpack


def unary_handler(fn):
    """A unary RoleService method served by the coroutine `fn(msg, context)`."""
    return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=unpack,
                                               response_serializer=pack)


class AioDecodeWorker:
    def __init__(self):
        self.num_open = self.num_cancelled = self.num_done = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="fake-aio-worker")
        self._thread.start()
        self.port = self._call(self._start())
        model_dir = default_model_dir()
        self.info = WorkerInfo(
            role="decode", address=f"127.0.0.1:{self.port}", kv_address="127.0.0.1:1",
            model="a" * 64, tokenizer=router_identity(model_dir), max_model_len=1024,
            max_prompt_len=1023, vocab_size=ModelConfig.from_dir(model_dir).vocab_size,
            page_size=16, dtype="float32", kv_transport="grpc")

    def _call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _handlers(self) -> dict:
        """The RoleService methods served, by name; a subclass adds its own to these."""
        return {"Info": unary_handler(self._info),
                "Decode": grpc.unary_stream_rpc_method_handler(
                    self._decode, request_deserializer=unpack, response_serializer=pack),
                "Reprefill": unary_handler(self._reprefill),
                "Abort": unary_handler(self._abort)}

    async def _start(self) -> int:
        self.gate = asyncio.Event()
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(ROLE_SERVICE, self._handlers()),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    async def _reprefill(self, msg, context) -> dict:
        return {"ok": True}

    async def _abort(self, msg, context) -> dict:
        return {"aborted": True}

    async def _info(self, msg, context) -> dict:
        return {**self.info.to_wire(), "free_slots": 8, "free_pages": 100, "queue": 0}

    async def _decode(self, msg, context):
        self.num_open += 1
        try:
            yield {"registered": True}
            await self.gate.wait()
            r = msg["request"]
            for _ in range(r["params"]["max_tokens"] - len(r["output_ids"])):
                yield {"token_ids": [7], "finish": None, "abort_reason": None}
            self.num_done += 1
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.num_open -= 1

    def register(self, router_address: str) -> None:
        register(router_address, self.info, {"free_slots": 8, "free_pages": 100, "queue": 0},
                 NO_AUTH, timeout=10)

    def open_gate(self) -> None:
        self._loop.call_soon_threadsafe(self.gate.set)

    def close(self) -> None:
        self._call(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
