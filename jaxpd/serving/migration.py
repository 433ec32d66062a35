"""A draining decode worker's running requests move to other decode workers with their
KV (`--migrate_on_drain`), instead of being prefilled again there.

The worker side, `MigrationOutbox`:
1. `drain(deadline)` refuses new calls (`draining`), then, until its engine is idle or
   the deadline passes, cuts every decoding request out of the pool
   (`engine.kv.migration.take_decoding`) and holds its handoff, and ends the request's
   Decode stream with a {"migrating"} event, after every token it made.
2. The router, reading that event, opens a Decode stream for the request at another
   decode worker (a mirror waiting for KV, holding every token the client has seen) and
   calls `Migrate` here with that worker's KV address: `send` streams the held handoff
   there over the KV connector; the target checks it like any handoff and goes on from
   the next token. A request the router does not ask for within `hold_s` is dropped.
3. A move that fails (the target gone, a transfer error) answers the router an error
   with the reason; the router then has the request prefilled again for the target,
   as it does for any lost decode stream (`RequestFlow`).

Requests still waiting for their KV or prefilling here when the drain starts become
decoding and move on a later round. Either KV transport carries a migration, with the
sender a prefill worker would use: the gRPC stream pushes the pages inside `send`;
the transfer server (`make_sender` starts one in this process, beside the receiver's)
offers them, and the target pulls them after `send` returns, so `drain` also waits
until every offer is pulled (or expired) before it returns and the process may exit.
A pulled handoff is one device's copy of the pages (`one_device`): the target pulls a
sender's exact layout, and a copy per device of the decode mesh would cost as many.

No thread of its own: `drain` runs on the caller's (the worker's main thread on
SIGTERM, the `SwitchRole` call's), `send` on the gRPC pool thread of a `Migrate` call.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.engine.kv.migration import Migrant, has_decoding, take_decoding

_log = logging.getLogger(__name__)

MIGRATING = "migrating"      # the finish of a Decode stream whose request moves


class NotHeld(LookupError):
    """`Migrate` named a request this worker holds no handoff of."""


class MigrationOutbox:
    """The handoffs of a draining decode worker's requests, until the router sends them
    (see the module). `make_sender()`: the `KVSender` to a decode worker's KV address,
    made at the first move (default: a `GrpcSender` with `auth`); `one_device`: hand
    it the pages on one device (a sender whose peer pulls them)."""

    def __init__(self, engine, auth: InternalAuth = NO_AUTH, hold_s: float = 30.0,
                 make_sender: Callable[[], object] | None = None, one_device: bool = False):
        self.engine, self.hold_s, self.one_device = engine, hold_s, one_device
        self.draining: str | None = None       # why new calls are refused
        self._auth, self._make_sender, self._sender = auth, make_sender, None
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Migrant, float]] = {}   # request id -> (it, expiry)
        self.num_sent = self.num_failed = self.num_dropped = 0

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def drain(self, deadline: float, why: str = "this decode worker is draining") -> None:
        """Refuse new calls, move every running request out, and wait (up to the
        `time.monotonic()` `deadline`) until the engine is idle and every held handoff
        was sent or dropped."""
        self.draining = why
        _log.info("%s: moving its running requests to other decode workers", why)
        while time.monotonic() < deadline:
            self._expire()
            if self.engine.error is None and has_decoding(self.engine):
                for m in take_decoding(self.engine):
                    with self._lock:
                        self._held[m.request.request_id] = (m, time.monotonic() + self.hold_s)
                    m.request.events.put(([], MIGRATING))
            if self.engine.is_idle() and self.num_held == 0 and self._pulled():
                return
            time.sleep(0.02)
        _log.warning("drain deadline: %d requests still held for migration, %d offers not "
                     "yet pulled", self.num_held, self._offers_pending())

    def send(self, request_id: str, destination: str) -> None:
        """Stream `request_id`'s held handoff to the decode worker whose KV address is
        `destination`; it is forgotten here either way. Raises `NotHeld`, or the
        connector's `TransferError` saying why the move failed."""
        with self._lock:
            held = self._held.pop(request_id, None)
        if held is None:
            raise NotHeld(f"no migrating request {request_id!r} is held here")
        migrant = held[0]
        handoff = dataclasses.replace(migrant.handoff, destination=destination)
        try:
            if self.one_device:
                handoff = _on_one_device(handoff)
            self._connector().send(handoff)
        except Exception:
            with self._lock:
                self.num_failed += 1
            raise
        with self._lock:
            self.num_sent += 1
        _log.info("moved %s (%d tokens of KV) to %s", request_id, migrant.handoff.num_tokens,
                  destination)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        if self._sender is not None:
            self._sender.close()

    def _connector(self):
        with self._lock:
            if self._sender is None:
                if self._make_sender is not None:
                    self._sender = self._make_sender()
                else:
                    from jaxpd.transfer.grpc_stream import GrpcSender
                    self._sender = GrpcSender(auth=self._auth)
            return self._sender

    def _offers_pending(self) -> int:
        """Offers of a pulling sender not yet pulled (nor expired); 0 for a pushing one."""
        with self._lock:
            sender = self._sender
        pending = getattr(sender, "pending", None)
        return pending() if pending is not None else 0

    def _pulled(self) -> bool:
        return self._offers_pending() == 0

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [k for k, (_, expiry) in self._held.items() if expiry < now]
            for k in late:
                del self._held[k]
            self.num_dropped += len(late)
        for k in late:
            _log.warning("dropped the held KV of %s: the router did not move it within "
                         "%.0f s", k, self.hold_s)


def _on_one_device(handoff):
    """`handoff` with its pages copied onto the first device holding them."""
    import jax
    device = next(iter(handoff.k.sharding.device_set))
    k, v = jax.device_put((handoff.k, handoff.v), jax.sharding.SingleDeviceSharding(device))
    return dataclasses.replace(handoff, k=k, v=v)
