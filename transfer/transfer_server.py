"""Cross-process KV transfer: the JAX transfer server moves the pages, gRPC the metadata.

Prefill side (`TransferServerSender`), `send(handoff)`:
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
Decode side (`TransferServerReceiver`):
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

Why this sender stages nothing (unlike `DevicePutConnector`, whose copy would be
issued only after the prefill loop dispatched its next batch, and could wait behind
it): the transfer server (jaxlib's socket transfer, as its source reads) copies an
offered buffer with `CopyRawToHost` once the buffer is ready, not as a program queued
on the prefill devices, so a pull is not ordered behind a later prefill batch; and
on CPU (checksums on by default) `send` reads the pages to host before it returns,
before the next batch is dispatched. What a long prefill can still take from a pull
in a CPU prefill process is CPU time: pin the roles to separate cores. Not yet
measured across processes (issue 12).

Integrity (`verify_checksums`): the sender puts a crc32 of every page of k and v in
the Offer (`transfer.checksum`), and the receiver checks the pulled arrays against
them before resharding; a mismatch is a `ChecksumMismatchError` (the Ack says the pull
completed, so the sender does not try to reclaim it) and the request is prefilled
again.
The first token rides in the same Offer and is *trusted*, not recomputed: the decode
side could only recompute it with one more decode step per request (feed the last
prompt token over the received pages, sample with the request's seed), and that step
would trust the same pages the checksums already bind to the Offer. The Offer itself
comes over the authenticated control plane (cluster token or mTLS); the decode side
checks the token is inside its vocabulary and the pages match its own page count for
`num_tokens` (`transfer.inbound.HandoffSpec`). What no checksum can catch is an
authenticated peer that lies consistently -- that is what authentication is for.

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

import jax

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.transfer import jax_compat
from jaxpd.transfer.checksum import check_page_checksums, page_checksums
from jaxpd.transfer.connector import KVHandoff, TransferStats, next_or_none
from jaxpd.transfer.control import (Ack, BackpressureError, ControlClient, ControlServer, Offer,
                                    address_is_on, peer_ip)
from jaxpd.transfer.layout import ArrayLayout, check_layout, describe, shape_dtype_struct
from jaxpd.transfer.wire import TransferError, pack

MiB = 1 << 20
PULLED = "pulled, then refused: "   # an Ack error after a completed pull: nothing to reclaim

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
    verify_checksums: the sender crc32s every page it offers, the receiver checks the
      pulled pages against them (`transfer.checksum`). Cost, on each side: one pass of
      crc32 over the KV's host bytes (~GB/s, no compile) -- free of copies on CPU,
      where the pages already live in host memory, but a device -> host copy of the
      whole KV on an accelerator. None (default): on when `jax.default_backend()` is
      "cpu". A receiver checks the checksums an Offer carries; an Offer without them
      (its sender has them off) is taken unchecked.
    check_offer_addresses: an Offer may only name transfer and ack addresses on the
      host it came from (a peer with the cluster token still cannot point the decode
      side at a third machine); off for senders behind address translation.
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
    verify_checksums: bool | None = None
    check_offer_addresses: bool = True

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

    def checksums_on(self) -> bool:
        """`verify_checksums`, with None resolved for this process's backend (at use,
        not at construction: a default instance is built when this module loads)."""
        if self.verify_checksums is None:
            return jax.default_backend() == "cpu"
        return self.verify_checksums


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
    fallback = ("use jaxpd.transfer.grpc_stream's GrpcSender/GrpcReceiver instead "
                "(--kv_transport grpc)")
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


class _Endpoint:
    """What both sides share: this process's transfer server and a control server."""

    def __init__(self, control_address: str, options: TransferServerOptions,
                 auth: InternalAuth, **handlers):
        self.options = options
        self._auth = auth
        self._server = start_transfer_server(options)
        self.transfer_address = _advertised(self._server.address(), options.advertise_host)
        self._lock = threading.Condition()
        self._closed = False
        self._control = ControlServer(control_address, auth=auth, **handlers)
        self.control_address = _advertised(self._control.address, options.advertise_host)
        self._clients: dict[str, ControlClient] = {}

    def _client(self, address: str) -> ControlClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = ControlClient(address, self._auth)
            return self._clients[address]

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Stop the control plane. The JAX transfer server has no stop method; it goes
        with the process."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._control.stop()
        for client in self._clients.values():
            client.close()


class TransferServerSender(_Endpoint):
    """`KVSender` to decode sides in other processes or hosts: offers go to each
    handoff's `destination` (a `TransferServerReceiver.control_address`), or to
    `decode_control_address` when it has none."""

    def __init__(self, *, control_address: str = "127.0.0.1:0",
                 decode_control_address: str | None = None,
                 options: TransferServerOptions = TransferServerOptions(),
                 auth: InternalAuth = NO_AUTH):
        super().__init__(control_address, options, auth, on_ack=self._on_ack)
        self._default_destination = decode_control_address
        self._pending: dict[int, _Pending] = {}
        # jax < 0.10.1 cannot expire offers in the server: we end them ourselves.
        self._server_expires_offers = jax_compat.await_pull_takes_timeout()
        self._reclaimer = futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpd-reclaim")
        self.reclaimed = 0       # offers ended by pulling them back (never pulled by a peer)

    def send(self, handoff: KVHandoff) -> None:
        """Offer the handoff's pages and tell the decode side; blocks while
        `max_pending` offers await their ack."""
        self._check_open()
        if not isinstance(handoff.k, jax.Array) or not isinstance(handoff.v, jax.Array):
            raise TypeError("send needs k and v as jax.Array on this process's devices")
        uuid = secrets.randbits(63)
        sums = ((page_checksums(handoff.k), page_checksums(handoff.v))
                if self.options.checksums_on() else (None, None))
        offer = Offer(uuid=uuid, request_id=handoff.request_id,
                      num_tokens=handoff.num_tokens, first_token=handoff.first_token,
                      k=describe(handoff.k), v=describe(handoff.v),
                      transfer_address=self.transfer_address,
                      ack_address=self.control_address, payload=handoff.payload,
                      part=handoff.part, k_checksums=sums[0], v_checksums=sums[1],
                      first_page=handoff.first_page)
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
            client = self._client(self._destination(handoff))
            client.offer(offer, timeout=self.options.rpc_timeout_s)
        except TransferError:
            # Nobody will pull it: end the offer now rather than at its TTL.
            self._release(uuid, reclaim=True)
            raise

    def _destination(self, handoff: KVHandoff) -> str:
        address = handoff.destination or self._default_destination
        if address is None:
            raise TransferError(f"handoff {handoff.request_id!r} names no decode destination "
                                f"and the connector has no default")
        return address

    def wait_pulled(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for every offer made so far to be acked (pulled,
        or refused); returns how many still wait. The prefill loop calls it before its
        next batch: the pull is served by this process, and a long prefill dispatched
        first would hold it up (issue 12's handoff stall, across processes)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            waiting = set(self._pending)
            while True:
                self._drop_expired()
                waiting &= self._pending.keys()
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    return len(waiting)
                self._lock.wait(timeout=min(left, 0.1))

    def pending(self) -> int:
        """Offers not yet acked and not yet expired."""
        with self._lock:
            self._drop_expired()
            return len(self._pending)

    def counts(self) -> dict[str, int]:
        return {"offers_reclaimed": self.reclaimed}

    def _wait_for_room(self) -> None:
        with self._lock:
            while True:
                self._check_open()
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
            _log.warning("decode side failed to take offer %d: %s", ack.uuid, ack.error)
        # Pulled (even if the pages were then refused): the server has let go. Not
        # pulled (discarded, or the peer's pull failed): end the offer in the server too.
        self._release(ack.uuid, reclaim=bool(ack.error) and not ack.error.startswith(PULLED))

    def close(self) -> None:
        """Also drop the arrays of offers not yet acked."""
        with self._lock:
            self._pending.clear()
        super().close()
        self._reclaimer.shutdown(wait=True, cancel_futures=True)


class TransferServerReceiver(_Endpoint):
    """`KVReceiver` from prefill sides in other processes or hosts: offers arrive on
    `control_address` and say where to pull from."""

    def __init__(self, *, control_address: str = "127.0.0.1:0",
                 options: TransferServerOptions = TransferServerOptions(),
                 auth: InternalAuth = NO_AUTH):
        self._queue: queue.Queue[RemoteKVHandoff] = queue.Queue(maxsize=options.max_pending)
        super().__init__(control_address, options, auth, on_offer=self._on_offer)

    def _on_offer(self, offer: Offer, seconds_left: float | None, peer: str) -> None:
        if self._closed:
            raise BackpressureError("decode side is closed")
        if self.options.check_offer_addresses:
            # The data plane (the JAX transfer server) has no auth of its own: pull only
            # from, and ack only to, the host whose authenticated Offer this is.
            ip = peer_ip(peer)
            for field in ("transfer_address", "ack_address"):
                if not address_is_on(getattr(offer, field), ip):
                    raise ValueError(f"offer's {field} {getattr(offer, field)!r} is not on "
                                     f"the host it came from ({peer})")
        handoff = RemoteKVHandoff(
            request_id=offer.request_id, num_tokens=offer.num_tokens,
            first_token=offer.first_token, k=_struct(offer.k), v=_struct(offer.v),
            payload=offer.payload, part=offer.part, first_page=offer.first_page, offer=offer)
        try:
            self._queue.put(handoff, timeout=max(0.0, (seconds_left or 1.0) - 0.1))
        except queue.Full:
            raise BackpressureError(
                f"{self._queue.maxsize} handoffs already wait to be placed") from None

    def receive(self, timeout: float | None) -> RemoteKVHandoff | None:
        """The next offer, pages not moved yet; None after `timeout` seconds
        (None or 0: do not wait), like `DevicePutConnector`."""
        self._check_open()
        return next_or_none(self._queue, timeout)

    def place(self, handoff: RemoteKVHandoff, sharding: jax.sharding.Sharding
              ) -> tuple[jax.Array, jax.Array, TransferStats]:
        """Pull the pages in the sender's layout, check them against the Offer's
        checksums, reshard onto `sharding`, ack. Every failure is a `TransferError`:
        what arrives here is a peer's word."""
        self._check_open()
        offer = handoff.offer
        start = time.perf_counter()
        pulled = False
        try:
            k_raw, v_raw = self._pull(offer)
            pulled = True
            if self.options.checksums_on() and (offer.k_checksums, offer.v_checksums) != (
                    None, None):
                self._verify(offer, k_raw, v_raw)
            k, v = jax.block_until_ready(jax.device_put((k_raw, v_raw), sharding))
        except Exception as e:
            self._ack(offer, error=(PULLED if pulled else "") + f"{type(e).__name__}: {e}")
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"placing {offer.request_id!r} (uuid {offer.uuid}) failed: "
                                f"{type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        self._ack(offer)
        return k, v, TransferStats(int(k.nbytes) + int(v.nbytes), seconds)

    def discard(self, handoff: RemoteKVHandoff) -> None:
        """Ack without pulling: the sender drops its arrays now instead of at the TTL."""
        self._check_open()
        self._ack(handoff.offer, error="discarded: request cancelled or superseded")

    def counts(self) -> dict[str, int]:
        return {}

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

    @staticmethod
    def _verify(offer: Offer, k: jax.Array, v: jax.Array) -> None:
        what = f"pull of {offer.request_id!r} (uuid {offer.uuid})"
        if offer.k_checksums is None or offer.v_checksums is None:
            raise TransferError(f"{what}: the Offer has checksums for only one of k and v")
        check_page_checksums("k", k, offer.k_checksums, what)
        check_page_checksums("v", v, offer.v_checksums, what)

    def _ack(self, offer: Offer, error: str = "") -> None:
        self._client(offer.ack_address).ack(Ack(offer.uuid, error=error),
                                            timeout=self.options.rpc_timeout_s)


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
