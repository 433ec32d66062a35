"""A fake decode worker (`AioDecodeWorker`'s server) for router tests of live migration:
the first Decode stream of a fresh request streams `before` tokens, then says the
request moves ({"migrating"}); `Migrate` answers that the KV was sent. A Decode stream
of a request that holds tokens already (the router's mirror at the move's target)
streams the rest, its first event saying `move_failure` when one is set: the target's
word that the sent KV never landed and it prefilled the request again."""
from __future__ import annotations

from tests.support.aio_decode_worker import AioDecodeWorker, unary_handler


class MovingDecodeWorker(AioDecodeWorker):
    def __init__(self, before: int = 2, move_failure=None):
        self.before, self.move_failure = before, move_failure
        self.migrate_calls: list[dict] = []
        super().__init__()

    def _handlers(self) -> dict:
        return {**super()._handlers(), "Migrate": unary_handler(self._migrate)}

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
