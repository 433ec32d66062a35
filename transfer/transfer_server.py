"""Cross-process KV transfer: the JAX transfer server moves the pages, gRPC the metadata.

Prefill side (`role="prefill"`), `send(handoff)`:
  1. describe k and v (`ArrayLayout`), offer them to the local transfer server under a
     fresh random uuid: `await_pull(uuid, [k, v], timeout=now + offer_ttl_s)`;
  2. keep k and v referenced until the decode side acks (or the TTL passes: the
     transfer server forgets the uuid at the same deadline). An offer that will never
     be pulled (the decode side discarded it, or failed its pull, or the control
     message never arrived) is ended at once by pulling it back from our own server
     ("reclaim": each uuid can be pulled once), so its pages do not wait for the TTL;
     on jax < 0.10.1, whose `await_pull` has no timeout, expired offers are reclaimed
     the same way;
  3. send an `Offer` (uuid, layouts, addresses, request metadata) to the decode side's
     control server. A full decode queue blocks this call up to `rpc_timeout_s`, then
     fails with `BackpressureError`.
Decode side (`role="decode"`):
  `receive(timeout)` returns a `RemoteKVHandoff`: the request's metadata, k and v as
  `jax.ShapeDtypeStruct`s (nothing moved yet), and the offer. `place(handoff, sharding)`
  pulls exactly the sender's layout onto this process's first N devices, under a
  watchdog, reshards onto `sharding` with `jax.device_put`, and acks.

Why the pull is not onto `sharding` directly: the transfer server moves per-device
buffers; a pull in any other layout returns wrong numbers without an error
(see `transfer.layout`).

Threads: each side runs one gRPC control server (its own small pool), and the prefill
side one `jaxpd-reclaim` thread. `place` runs on
the caller's thread and polls the pulled arrays; on timeout it poisons the connection,
which fails the pending pull instead of leaving a thread blocked forever.

Seen with jax 0.10.2 on CPU: `pull(..., timeout=datetime)` is accepted but does not
end a pull of a uuid that is never offered; `await_pull(..., timeout=datetime)` does
expire the offer. The transfer server has no stop method: it lives until the process
exits, so `close()` only stops the control plane.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import secrets
import threading
import time
from concurrent import futures
from typing import Literal

import jax

from transfer import jax_compat
from transfer.connector import KVHandoff, TransferStats, next_or_none
from transfer.control import (Ack, BackpressureError, ControlClient, ControlServer, Offer,
                              pack)
from transfer.layout import (ArrayLayout, TransferError, check_layout, describe,
                             shape_dtype_struct)

Role = Literal["prefill", "decode"]
MiB = 1 << 20

_log = logging.getLogger(__name__)


class TransferServerUnavailable(TransferError):
    """This jax/backend has no usable `jax.experimental.transfer` server."""


class PullTimeoutError(TransferError, TimeoutError):
    """A pull did not complete in time: the offer expired, was never made, or the
    sender is unreachable."""


@dataclasses.dataclass(frozen=True)
class TransferServerOptions:
    """Knobs of the data plane and its deadlines.

    transport_addresses: bulk-transport sockets; must not be empty (jax 0.10.2 aborts
      the process on a failed internal check when it is).
    advertise_host: the host the peer should dial, when binding to 0.0.0.0 / [::].
    transfer_size: chunk size of the bulk copy; 4 MiB roughly doubles CPU loopback
      throughput over the 256 MiB default and maps far less memory.
    """
    transfer_address: str = "127.0.0.1:0"
    transport_addresses: tuple[str, ...] = ("127.0.0.1:0",)
    advertise_host: str | None = None
    transfer_size: int = 4 * MiB
    max_num_parallel_copies: int = 8
    offer_ttl_s: float = 60.0
    pull_timeout_s: float = 30.0
    rpc_timeout_s: float = 10.0
    max_pending: int = 64
    reclaim_timeout_s: float = 5.0

    def __post_init__(self):
        if not self.transport_addresses:
            raise ValueError("transport_addresses must not be empty, e.g. ('127.0.0.1:0',)")
        if self.transfer_size <= 0 or self.max_num_parallel_copies <= 0:
            raise ValueError("transfer_size and max_num_parallel_copies must be positive")
        for name in ("offer_ttl_s", "pull_timeout_s", "rpc_timeout_s", "reclaim_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_pending <= 0:
            raise ValueError(f"max_pending must be positive, got {self.max_pending}")


@dataclasses.dataclass
class RemoteKVHandoff(KVHandoff):
    """A handoff whose pages still sit on the prefill side.

    `k` and `v` are `jax.ShapeDtypeStruct`s (shape and dtype only) until `place`.
    """
    offer: Offer = dataclasses.field(kw_only=True)

    @property
    def num_bytes(self) -> int:
        return self.offer.k.nbytes + self.offer.v.nbytes


@dataclasses.dataclass(frozen=True)
class _Pending:
    """Arrays offered and not yet acked; referenced so nothing frees them early."""
    k: jax.Array
    v: jax.Array
    expires_at: float


def start_transfer_server(options: TransferServerOptions):
    """A `jax.experimental.transfer` server, or `TransferServerUnavailable` saying why."""
    fallback = "use transfer.grpc_stream.GrpcConnector instead (--kv_transport grpc)"
    reason = jax_compat.unavailable_reason()
    if reason is not None:
        raise TransferServerUnavailable(f"jax {jax.__version__} has no usable transfer "
                                        f"server: {reason}; {fallback}")
    from jax.experimental import transfer as jax_transfer
    try:
        return jax_transfer.start_transfer_server(
            jax.devices()[0].client, options.transfer_address,
            list(options.transport_addresses),
            max_num_parallel_copies=options.max_num_parallel_copies,
            transfer_size=options.transfer_size)
    except Exception as e:  # noqa: BLE001 -- backends fail with different types; all mean "unavailable"
        raise TransferServerUnavailable(
            f"the JAX transfer server could not start on {jax.default_backend()} "
            f"(jax {jax.__version__}): {type(e).__name__}: {e}; {fallback}") from e


def _advertised(address: str, host: str | None) -> str:
    return address if host is None else f"{host}:{address.rsplit(':', 1)[1]}"


class TransferServerConnector:
    """`Connector` for prefill and decode in separate processes or hosts.

    role="prefill": offers go to each handoff's `destination` (a decode side's
    `control_address`), or to `decode_control_address` when it has none; role="decode"
    takes neither: offers say where to pull from.
    """

    def __init__(self, role: Role, *, control_address: str = "127.0.0.1:0",
                 decode_control_address: str | None = None,
                 options: TransferServerOptions = TransferServerOptions()):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        if role == "decode" and decode_control_address is not None:
            raise ValueError("decode_control_address is not accepted for role='decode'")
        self.role = role
        self.options = options
        self._server = start_transfer_server(options)
        self.transfer_address = _advertised(self._server.address(), options.advertise_host)
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._queue: queue.Queue[RemoteKVHandoff] = queue.Queue(maxsize=options.max_pending)
        self._closed = False
        # jax < 0.10.1 cannot expire offers in the server: we end them ourselves.
        self._server_expires_offers = jax_compat.await_pull_takes_timeout()
        self._reclaimer = futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpd-reclaim")
        self.reclaimed = 0       # offers ended by pulling them back (never pulled by a peer)
        if role == "prefill":
            self._control = ControlServer(control_address, on_ack=self._on_ack)
            self._default_destination = decode_control_address
            self._decode_clients: dict[str, ControlClient] = {}
        else:
            self._control = ControlServer(control_address, on_offer=self._on_offer)
        self.control_address = _advertised(self._control.address, options.advertise_host)
        self._ack_clients: dict[str, ControlClient] = {}

    # -- prefill side -------------------------------------------------------------

    def send(self, handoff: KVHandoff) -> None:
        """Offer the handoff's pages and tell the decode side; blocks while
        `max_pending` offers await their ack."""
        self._require("prefill", "send")
        if not isinstance(handoff.k, jax.Array) or not isinstance(handoff.v, jax.Array):
            raise TypeError("send needs k and v as jax.Array on this process's devices")
        uuid = secrets.randbits(63)
        offer = Offer(uuid=uuid, request_id=handoff.request_id,
                      num_tokens=handoff.num_tokens, first_token=handoff.first_token,
                      k=describe(handoff.k), v=describe(handoff.v),
                      transfer_address=self.transfer_address,
                      ack_address=self.control_address, payload=handoff.payload,
                      part=handoff.part)
        try:
            pack(offer.to_dict())
        except (TypeError, ValueError) as e:
            raise TypeError(f"payload of {handoff.request_id!r} must be msgpack-able "
                            f"(dicts, lists, str, numbers, bytes): {e}") from e
        self._wait_for_room()
        ttl = self.options.offer_ttl_s
        if self._server_expires_offers:
            self._server.await_pull(uuid, [handoff.k, handoff.v], timeout=(
                datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=ttl)))
        else:
            self._server.await_pull(uuid, [handoff.k, handoff.v])
        with self._lock:
            self._pending[uuid] = _Pending(handoff.k, handoff.v, time.monotonic() + ttl)
        try:
            self._decode_client(handoff).offer(offer, timeout=self.options.rpc_timeout_s)
        except TransferError:
            # Nobody will pull it: end the offer now rather than at its TTL.
            self._release(uuid, reclaim=True)
            raise

    def _decode_client(self, handoff: KVHandoff) -> ControlClient:
        address = handoff.destination or self._default_destination
        if address is None:
            raise TransferError(f"handoff {handoff.request_id!r} names no decode destination "
                                f"and the connector has no default")
        with self._lock:
            if address not in self._decode_clients:
                self._decode_clients[address] = ControlClient(address)
            return self._decode_clients[address]

    def pending(self) -> int:
        """Offers not yet acked and not yet expired."""
        with self._lock:
            self._drop_expired()
            return len(self._pending)

    def _wait_for_room(self) -> None:
        with self._lock:
            while True:
                if self._closed:
                    raise TransferError("TransferServerConnector is closed")
                self._drop_expired()
                if len(self._pending) < self.options.max_pending:
                    return
                self._lock.wait(timeout=0.1)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for uuid in [u for u, p in self._pending.items() if p.expires_at <= now]:
            _log.warning("offer %d expired without an ack; its arrays are freed", uuid)
            expired = self._pending.pop(uuid)
            if not self._server_expires_offers:
                self._reclaim_later(uuid, expired)

    def _release(self, uuid: int, reclaim: bool = False) -> None:
        """Forget an offer; `reclaim`: nobody pulled it, so also end it in the server
        (which otherwise holds the pages until the offer's timeout, or for good on
        jax < 0.10.1)."""
        with self._lock:
            pending = self._pending.pop(uuid, None)
            self._lock.notify_all()
            if reclaim and pending is not None:
                self._reclaim_later(uuid, pending)

    def _reclaim_later(self, uuid: int, pending: _Pending) -> None:
        if not self._closed:
            self._reclaimer.submit(self._reclaim, uuid, pending)

    def _reclaim(self, uuid: int, pending: _Pending) -> None:
        """End an offer by pulling it from our own server in its exact layout (a uuid
        can be pulled once); the copy is dropped at once. Under a short watchdog: if
        a peer's pull of it is stuck mid-way, we give up and say so."""
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                 for a in (pending.k, pending.v)]
        try:
            connection = self._server.connect(self._server.address())
            arrays = connection.pull(uuid, specs)
            _wait_ready(arrays, connection, self.options.reclaim_timeout_s,
                        f"reclaim of offer {uuid}")
            jax.block_until_ready(arrays)
            self.reclaimed += 1
        except Exception as e:  # noqa: BLE001 -- best effort: a peer may have pulled it after all
            _log.warning("could not end offer %d in the transfer server (%s); its pages stay "
                         "there until the offer's timeout or the process exits", uuid, e)

    def _on_ack(self, ack: Ack) -> None:
        if ack.error and not ack.error.startswith("discarded"):
            _log.warning("decode side failed to pull offer %d: %s", ack.uuid, ack.error)
        # Pulled: the server has let go. Not pulled (discarded, or the peer's pull
        # failed): end the offer in the server too.
        self._release(ack.uuid, reclaim=bool(ack.error))

    # -- decode side --------------------------------------------------------------

    def _on_offer(self, offer: Offer, seconds_left: float | None) -> None:
        if self._closed:
            raise BackpressureError("decode side is closed")
        handoff = RemoteKVHandoff(
            request_id=offer.request_id, num_tokens=offer.num_tokens,
            first_token=offer.first_token, k=_struct(offer.k), v=_struct(offer.v),
            payload=offer.payload, part=offer.part, offer=offer)
        try:
            self._queue.put(handoff, timeout=max(0.0, (seconds_left or 1.0) - 0.1))
        except queue.Full:
            raise BackpressureError(
                f"{self._queue.maxsize} handoffs already wait to be placed") from None

    def receive(self, timeout: float | None) -> RemoteKVHandoff | None:
        """The next offer, pages not moved yet; None after `timeout` seconds
        (None or 0: do not wait), like `DevicePutConnector`."""
        self._require("decode", "receive")
        return next_or_none(self._queue, timeout)

    def place(self, handoff: KVHandoff, sharding: jax.sharding.Sharding
              ) -> tuple[jax.Array, jax.Array, TransferStats]:
        """Pull the pages in the sender's layout, reshard onto `sharding`, ack."""
        self._require("decode", "place")
        if not isinstance(handoff, RemoteKVHandoff):
            raise TypeError("place needs a RemoteKVHandoff from this connector's receive()")
        offer = handoff.offer
        start = time.perf_counter()
        try:
            k_raw, v_raw = self._pull(offer)
            k, v = jax.block_until_ready(jax.device_put((k_raw, v_raw), sharding))
        except Exception as e:
            self._ack(offer, error=f"{type(e).__name__}: {e}")
            raise
        seconds = time.perf_counter() - start
        self._ack(offer)
        return k, v, TransferStats(int(k.nbytes) + int(v.nbytes), seconds)

    def discard(self, handoff: KVHandoff) -> None:
        """Ack without pulling: the sender drops its arrays now instead of at the TTL."""
        self._require("decode", "discard")
        self._ack(handoff.offer, error="discarded: request cancelled or superseded")

    def _pull(self, offer: Offer) -> tuple[jax.Array, jax.Array]:
        specs = [shape_dtype_struct(offer.k), shape_dtype_struct(offer.v)]
        # A fresh connection per pull (~1 ms) so that poisoning a stuck one fails
        # only this pull.
        connection = self._server.connect(offer.transfer_address)
        arrays = connection.pull(offer.uuid, specs)
        _wait_ready(arrays, connection, self.options.pull_timeout_s,
                    f"pull of {offer.request_id!r} (uuid {offer.uuid}) from {offer.transfer_address}")
        try:
            k_raw, v_raw = jax.block_until_ready(arrays)
        except jax.errors.JaxRuntimeError as e:
            raise TransferError(f"pull of {offer.request_id!r} (uuid {offer.uuid}) from "
                                f"{offer.transfer_address} failed: {e}") from e
        check_layout(offer.k, describe(k_raw))
        check_layout(offer.v, describe(v_raw))
        return k_raw, v_raw

    def _ack(self, offer: Offer, error: str = "") -> None:
        with self._lock:
            client = self._ack_clients.get(offer.ack_address)
            if client is None:
                client = ControlClient(offer.ack_address)
                self._ack_clients[offer.ack_address] = client
        client.ack(Ack(offer.uuid, error=error), timeout=self.options.rpc_timeout_s)

    # -- both ---------------------------------------------------------------------

    def _require(self, role: Role, method: str) -> None:
        if self.role != role:
            raise RuntimeError(f"{method}() is for role={role!r}; this connector is "
                               f"role={self.role!r}")
        if self._closed:
            raise TransferError("TransferServerConnector is closed")

    def close(self) -> None:
        """Stop the control plane and drop pending arrays. The JAX transfer server has
        no stop method; it goes with the process."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._lock.notify_all()
        self._control.stop()
        self._reclaimer.shutdown(wait=True, cancel_futures=True)
        if self.role == "prefill":
            for client in self._decode_clients.values():
                client.close()
        for client in self._ack_clients.values():
            client.close()


def _struct(layout: ArrayLayout) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(layout.shape, layout.dtype)


def _wait_ready(arrays: list[jax.Array], connection, timeout: float, what: str) -> None:
    """Poll until every pulled array is ready, or poison the connection and raise.

    Polling, not a blocking wait on a helper thread: a blocked thread could never be
    ended if the pull never completes.
    """
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not all(a.is_ready() for a in arrays):
        if time.monotonic() >= deadline:
            poison = getattr(connection, "_poison_connection", None)
            if poison is not None:
                poison()
            raise PullTimeoutError(
                f"{what} did not finish in {timeout:.1f}s: the offer expired, was never "
                f"made, or the sender is gone")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)
