"""A fake decode worker (`AioDecodeWorker`'s server) for router tests of live migration:
the first Decode stream of a fresh request streams `before` tokens, then says the
request moves ({"migrating"}); `Migrate` answers that the KV was sent. A Decode stream
of a request that holds tokens already (the router's mirror at the move's target)
streams the rest, its first event saying `move_failure` when one is set: the target's
word that the sent KV never landed and it prefilled the request again."""
from __future__ import annotations

import asyncio

import grpc

from jaxpd.serving.role_rpc import ROLE_SERVICE
from jaxpd.transfer.wire import pack, unpack
from tests.support.aio_decode_worker import AioDecodeWorker


class MovingDecodeWorker(AioDecodeWorker):
    def __init__(self, before: int = 2, move_failure=None):
        self.before, self.move_failure = before, move_failure
        self.migrate_calls: list[dict] = []
        super().__init__()

    async def _start(self) -> int:
        self.gate = asyncio.Event()
        self._server = grpc.aio.server()
        unary = lambda fn: grpc.unary_unary_rpc_method_handler(   # noqa: E731
            fn, request_deserializer=unpack, response_serializer=pack)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            ROLE_SERVICE, {
                "Info": unary(self._info),
                "Decode": grpc.unary_stream_rpc_method_handler(
                    self._decode, request_deserializer=unpack, response_serializer=pack),
                "Reprefill": unary(self._reprefill), "Abort": unary(self._abort),
                "Migrate": unary(self._migrate)}),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    async def _migrate(self, msg, context) -> dict:
        self.migrate_calls.append(msg)
        return {"sent": True}

    async def _decode(self, msg, context):
        self.num_open += 1
        try:
            r = msg["request"]
            yield {"registered": True}
            if not r["output_ids"]:                            # the source
                for _ in range(self.before):
                    yield {"token_ids": [7], "finish": None, "abort_reason": None}
                yield {"migrating": True}
                return
            left = r["params"]["max_tokens"] - len(r["output_ids"])
            for i in range(left):
                event = {"token_ids": [8], "finish": "length" if i == left - 1 else None,
                         "abort_reason": None}
                if i == 0 and self.move_failure is not None:
                    event["migration_failed"] = self.move_failure
                yield event
            self.num_done += 1
        finally:
            self.num_open -= 1
