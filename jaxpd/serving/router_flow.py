"""How the router runs one request, as a coroutine on the router's event loop: pick a
decode worker and open its stream, have a prefill worker send the KV there (or the
decode worker prefill itself), relay the tokens, and fail over to another decode
worker when the stream breaks. A request keeps the model version (fingerprint) it
started on: every worker it meets serves that fingerprint.

`RequestFlow` is handed the `WorkerPool` it chooses from and reports its calls to (so
losing a worker cancels them). Every worker call is a `grpc.aio` call on the loop
(`AsyncRoleClient`, one per worker address, made on the loop): a request in flight
costs a coroutine, not a thread.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from jaxpd.request import Request, State
from jaxpd.auth import InternalAuth
from jaxpd.serving.prefix_index import PrefixIndex, PrefixQuery
from jaxpd.serving.role_rpc import AsyncRoleClient, check_move_failure, check_tokens
from jaxpd.serving.router_config import RouterConfig
from jaxpd.serving.worker_pool import Call, Worker, WorkerPool
from jaxpd.stats import StatsCounter

_log = logging.getLogger("jaxpd.serving.router")


class _EndedEarly(Exception):
    """A decode stream ended without a final event."""


class _Migrating(Exception):
    """A draining decode worker ended the stream to move the request with its KV."""


def _cancelled_by_us() -> bool:
    """A CancelledError came from a call we cancelled, not from cancelling our task."""
    task = asyncio.current_task()
    return task is None or not task.cancelling()


class RequestFlow:
    """Runs requests against `workers` (see the module docstring)."""

    def __init__(self, workers: WorkerPool, config: RouterConfig, counters: StatsCounter,
                 prefix: PrefixIndex | None, vocab_size: int, auth: InternalAuth):
        self.workers, self.config, self.counters = workers, config, counters
        self.prefix, self.vocab_size, self.auth = prefix, vocab_size, auth
        self._clients: dict[str, AsyncRoleClient] = {}   # by address; touched on the loop only

    def client(self, w: Worker) -> AsyncRoleClient:
        """On the loop: `w`'s asyncio client (one per address, kept across epochs)."""
        if w.address not in self._clients:
            self._clients[w.address] = AsyncRoleClient(w.address, self.auth)
        return self._clients[w.address]

    async def close(self) -> None:
        """On the loop: close every worker channel."""
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.close()

    def _track(self, r: Request, w: Worker, handle, watched: bool,
               destination: Worker | None = None) -> Call:
        return self.workers.track(r.request_id, w, handle, asyncio.get_running_loop(),
                                  watched, destination)

    async def run(self, r: Request) -> None:
        """Run `r` until it is final; never raises (an error aborts it with the reason)."""
        try:
            await self._run_until_final(r)
        except Exception as e:   # never leave a request hanging
            _log.exception("router failed on %s", r.request_id)
            if r.abort(f"failed: {e!r}"):
                self.counters.add(aborted=1)
        # Counted once, here: `append_token` also answers True for a request that an
        # abort (counted where it happened) ended first.
        if r.state is State.FINISHED:
            self.counters.add(finished=1)

    async def _run_until_final(self, r: Request) -> None:
        tried: set[str] = set()
        query = self.prefix.query(r.prefill_ids) if self.prefix is not None else None
        source: Worker | None = None    # a draining decode worker holding r's KV for us
        moved_from: Worker | None = None   # the one that sent it to the decoder now
        model = self.workers.serving_model()
        while not r.is_final:
            decoders = [] if model is None else self.workers.live("decode", tried, model)
            if not decoders:
                why = ("failed: no decode worker reachable" if model is None else
                       f"failed: no decode worker of model {model[:12]} (the version this "
                       f"request started on) reachable")
                if r.abort(why):
                    self.counters.add(aborted=1)
                return
            decoder, cached, restorable = self.choose_decoder(decoders, query)
            client = self.client(decoder)
            call = self._track(r, decoder, client.decode(r.to_wire(), epoch=decoder.info.epoch),
                               watched=True)
            try:
                if r.is_final:                                 # aborted meanwhile
                    call.handle.cancel()
                    return
                if await call.handle.read() is grpc.aio.EOF:   # else: registered there
                    raise _EndedEarly("its stream ended before it began")
                if not r.is_final:
                    call.last_seen = None                      # not read while prefilling
                    moved_from, source = source, None
                    if moved_from is not None and \
                            not await self._migrate(r, moved_from, decoder):
                        moved_from = None                      # prefilled again, below
                    if moved_from is not None:
                        pass                                   # its KV is on its way there
                    elif restorable and \
                            r.num_tokens - restorable < self.config.prefix_extend_below:
                        # Its prefix is cached there (in the pool, or restorable from
                        # its host tier) and the rest is short: no trip through a
                        # prefill worker (conditional disaggregation).
                        self.counters.add(prefix_routed=1,
                                          prefix_host_routed=int(restorable > cached))
                        await client.reprefill(r.request_id, timeout=self.config.rpc_timeout_s,
                                               epoch=decoder.info.epoch)
                    else:
                        # Its handoff leaves out the pages the decoder is believed to
                        # hold (it checks, and prefills the request itself if not).
                        r.kv_skip_pages = min(cached, r.num_tokens - 1) // self.config.page_size
                        await self._prefill(r, decoder, query)
                    call.last_seen = time.monotonic()
                while True:
                    event = await call.handle.read()
                    if event is grpc.aio.EOF:
                        break
                    call.last_seen = time.monotonic()
                    if isinstance(event, dict) and event.get("migrating") is True:
                        raise _Migrating()
                    if isinstance(event, dict) and "migration_failed" in event and \
                            moved_from is not None:
                        self._move_failed(r, moved_from, decoder,
                                          check_move_failure(event["migration_failed"]))
                        moved_from = None
                    if self.relay(r, event):
                        if self.prefix is not None and r.state is State.FINISHED:
                            # KV is written for all of it but the last token.
                            self.prefix.record(decoder.address, r.prefill_ids[:-1])
                        return
                raise _EndedEarly("its stream ended early")
            except _EndedEarly as e:
                why = str(e)
            except _Migrating:
                why, source = None, decoder
            except ValueError as e:                            # from `relay`
                call.cancel(f"it sent a malformed event: {e}")
                why = call.why
            except asyncio.CancelledError:
                if not _cancelled_by_us():
                    call.handle.cancel()
                    raise
                if r.is_final:
                    return                                     # aborted: we cancelled it
                why = call.why or "cancelled"
            except grpc.RpcError as e:
                if r.is_final:
                    return
                why = call.why or str(e.code())
            finally:
                self.workers.untrack(call)
            tried.add(decoder.address)
            if source is decoder:
                _log.info("decode worker %s drains: moving %s with its KV", decoder.address,
                          r.request_id)
                continue
            _log.warning("decode worker %s lost %s (%s); re-running elsewhere",
                         decoder.address, r.request_id, why)
            self.counters.add(decode_failovers=1)

    async def _migrate(self, r: Request, source: Worker, target: Worker) -> bool:
        """Have draining `source` send r's KV to `target` (where r is registered and
        waits for it); True once sent. False, with the reason logged and counted, when
        the move failed: the caller prefills r again instead."""
        # No deadline either (see `_prefill`): the call ends with either worker's lease.
        call = self._track(r, source, self.client(source).migrate(
            r.request_id, target.info.kv_address, timeout=None, epoch=source.info.epoch),
            watched=False, destination=target)
        try:
            await call.handle
        except (grpc.RpcError, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and not _cancelled_by_us():
                call.handle.cancel()
                raise
            why = call.why or (f"{e.code()}: {e.details()}"
                               if isinstance(e, grpc.aio.AioRpcError) else repr(e))
            _log.warning("moving %s from %s to %s failed (%s); prefilling it again",
                         r.request_id, source.address, target.address, why)
            self.counters.add(migration_fallbacks=1)
            return False
        finally:
            self.workers.untrack(call)
        self.counters.add(migrations=1)
        return True

    def _move_failed(self, r: Request, source: Worker, target: Worker, why: str) -> None:
        """`target` says the KV `source` sent it for `r` did not land (`why`), and it
        prefilled `r` again itself: a failed migration, counted apart from a move the
        source could not send (`migration_fallbacks`)."""
        _log.warning("moving %s from %s to %s failed after its KV was sent (%s); %s "
                     "prefilled it again", r.request_id, source.address, target.address, why,
                     target.address)
        self.counters.add(migration_failures=1)

    def choose_decoder(self, decoders: list[Worker], query: PrefixQuery | None
                       ) -> tuple[Worker, int, int]:
        """The least loaded decode worker, unless one believed to hold a prefix of the
        request (`query`) has a free slot: then the one holding the longest, counting
        pages its host tier can restore, its pool's pages breaking ties. Returns it, the
        prefix tokens its pool is believed to hold, and those it can restore (pool and
        host tier)."""
        least = min(decoders, key=lambda w: (w.num_calls, -w.load["free_slots"]))
        if query is None:
            return least, 0, 0
        cached = {w.address: self.prefix.cached_tokens(w.address, query) for w in decoders}
        restorable = {w.address: max(cached[w.address],
                                     self.prefix.restorable_tokens(w.address, query))
                      for w in decoders}
        roomy = [w for w in decoders if restorable[w.address] and w.load["free_slots"] > 0]
        best = max(roomy, key=lambda w: (restorable[w.address], cached[w.address],
                                         -w.num_calls), default=least)
        return best, cached[best.address], restorable[best.address]

    def prefill_order(self, r: Request, decoder: Worker, query: PrefixQuery | None
                      ) -> list[Worker]:
        """Prefill workers of `decoder`'s fingerprint (another model's KV would be
        meaningless there), cheapest first: the tokens each would compute (all but the
        prefix its cache is believed to hold, `prefix_index`, counting what its host tier
        can restore) plus its queue, counted in requests of this one's length (Dynamo's
        "blocks to compute + load"); of two that compute as much, the one holding more in
        its pool (a restore is a copy). Without prefix routing, the least loaded first."""
        workers = self.workers.live("prefill", model=decoder.info.model)
        if query is None:
            return sorted(workers, key=lambda w: w.load["queue"] + w.num_calls)
        n = r.num_tokens

        def cost(w: Worker) -> tuple[int, int]:
            cached = min(self.prefix.cached_tokens(w.address, query), n - 1)
            restorable = min(max(cached, self.prefix.restorable_tokens(w.address, query)), n - 1)
            return n - restorable + (w.load["queue"] + w.num_calls) * n, -cached
        return sorted(workers, key=cost)

    async def _prefill(self, r: Request, decoder: Worker, query: PrefixQuery | None) -> None:
        """Have a prefill worker send r's KV to `decoder`, trying them cheapest first;
        the decode worker prefills r itself when none can.

        A Prefill call has no deadline: how long it takes depends on the prompts queued
        ahead of it and on compiles, and a slow call on a live worker is cancelled only
        to be computed again elsewhere. Liveness is what ends it: the call is tracked on
        its worker and its destination, so a worker whose lease lapses (or that the
        router drops for any reason) cancels it and the request fails over, and a worker
        whose process dies breaks the call's channel at once."""
        client = self.client(decoder)
        for p in self.prefill_order(r, decoder, query):
            call = self._track(r, p, self.client(p).prefill(
                r.to_wire(), decoder.info.kv_address, timeout=None,
                epoch=p.info.epoch), watched=False, destination=decoder)
            try:
                out = await call.handle
                finished = out.get("status") == "finished"     # its first token ended it
                if finished:
                    tokens = check_tokens(out, self.vocab_size, r.params.logprobs)
            except (grpc.RpcError, asyncio.CancelledError, ValueError) as e:
                if isinstance(e, asyncio.CancelledError) and not _cancelled_by_us():
                    call.handle.cancel()
                    raise
                if r.is_final or not decoder.live:
                    return          # (the decode stream, cancelled too, fails it over)
                why = call.why or (e.code() if isinstance(e, grpc.RpcError) else
                                   f"malformed answer: {e}" if isinstance(e, ValueError)
                                   else "cancelled")
                _log.warning("prefill worker %s failed %s (%s)", p.address, r.request_id, why)
                self.counters.add(prefill_failovers=1)
                continue
            finally:
                self.workers.untrack(call)
            if self.prefix is not None:
                # Its cache now holds the prompt's full pages (when it has one).
                self.prefix.record(p.address, r.prefill_ids)
            if finished:
                now = time.perf_counter()
                for t, logprobs in tokens:
                    r.append_token(t, now, logprobs)
                if out.get("finish_reason") in ("stop", "length"):
                    r.finish(out["finish_reason"])
                await client.abort(r.request_id, "finished at prefill",
                                   timeout=self.config.rpc_timeout_s, epoch=decoder.info.epoch)
            return
        # No prefill worker could: the decode worker prefills it on its own mesh.
        self.counters.add(decode_prefills=1)
        await client.reprefill(r.request_id, timeout=self.config.rpc_timeout_s,
                               epoch=decoder.info.epoch)

    def relay(self, r: Request, event: dict) -> bool:
        """Apply one decode event ({"alive"} carries nothing); True once the request is
        final. A malformed event raises ValueError before anything is applied."""
        tokens = check_tokens(event, self.vocab_size, r.params.logprobs)
        now = time.perf_counter()
        for t, logprobs in tokens:
            if r.append_token(t, now, logprobs):
                return True
        finish = event.get("finish")
        if finish in ("stop", "length"):        # e.g. a stop string the worker matched
            r.finish(finish)
            return True
        if finish == "abort":
            if r.abort(event.get("abort_reason") or "aborted by the decode worker"):
                self.counters.add(aborted=1)
            return True
        return r.is_final
