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
  3. send an `Offer` (uuid, layouts, addresses, request metadata, the model's
     fingerprint) to the decode side's control server. A full decode queue blocks this
     call up to `rpc_timeout_s`, then fails with `BackpressureError`.
Decode side (`TransferServerReceiver`):
  `receive(timeout)` returns a `RemoteKVHandoff`: the request's metadata, k and v as
  `jax.ShapeDtypeStruct`s (nothing moved yet), and the offer. `place(handoff, sharding)`
  pulls exactly the sender's layout onto this process's first N devices, under a
  watchdog, reshards onto `sharding` with `jax.device_put`, and acks.

Pieces (the leader of a prefill mesh spanning processes, `engine.multihost.shard_offers`): the
Offer lists where each range of kv heads waits -- this process's own shards under the
Offer's uuid, each follower's under its own -- and `k`/`v` describe the whole arrays.
The receiver pulls every piece from its owner at once, checks each, joins them along
the kv heads, and acks to the leader with the uuids it did pull (`Ack.pulled`); the
leader ends its own unpulled piece as above and has each follower end its own.

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
measured across processes.

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
checks the token is inside its vocabulary, the pages match its own page count for
`num_tokens`, and the Offer's model fingerprint is its own -- before `place` pulls
anything (`transfer.inbound.HandoffSpec`): pages of the right shape from other weights
would decode to gibberish. What no checksum can catch is an authenticated peer that
lies consistently -- that is what authentication is for.

Seen with jax 0.10.2 on CPU: `pull(..., timeout=datetime)` is accepted but does not
end a pull of a uuid that is never offered; `await_pull(..., timeout=datetime)` does
expire the offer. The transfer server has no stop method: it lives until the process
exits, so `close()` only stops the control plane.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from concurrent import futures

import jax

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.transfer import jax_compat
from jaxpd.transfer.checksum import page_checksums
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.control import Ack, Offer
from jaxpd.transfer.endpoint import (MiB, PULLED, Endpoint, PullTimeoutError,  # noqa: F401
                                     TransferServerOptions, TransferServerUnavailable,
                                     offer_arrays, reclaim_offer, start_transfer_server,
                                     wait_ready)
from jaxpd.transfer.layout import describe
from jaxpd.transfer.transfer_receiver import (RemoteKVHandoff,  # noqa: F401 (re-exported)
                                              TransferServerReceiver)
from jaxpd.transfer.wire import TransferError, pack

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """Arrays offered and not yet acked; referenced so nothing frees them early.
    `remote`: the uuids of the other processes' pieces of a pieces Offer, which
    `board` ends when nobody pulled them."""
    arrays: tuple[jax.Array, ...]
    expires_at: float
    remote: tuple[int, ...] = ()
    board: object = None


class TransferServerSender(Endpoint):
    """`KVSender` to decode sides in other processes or hosts: offers go to each
    handoff's `destination` (a `TransferServerReceiver.control_address`), or to
    `decode_control_address` when it has none. A handoff whose k and v are
    `engine.multihost.shard_offers.ShardedPages` (the leader of a prefill mesh spanning
    processes) is offered as pieces: this process's shards, and the followers'."""

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
        uuid = secrets.randbits(63)
        fields = dict(uuid=uuid, request_id=handoff.request_id,
                      num_tokens=handoff.num_tokens, first_token=handoff.first_token,
                      transfer_address=self.transfer_address,
                      ack_address=self.control_address, payload=handoff.payload,
                      part=handoff.part, first_page=handoff.first_page,
                      fingerprint=handoff.fingerprint)
        remote, board = (), None
        if hasattr(handoff.k, "board"):           # ShardedPages: offered as pieces
            board = handoff.k.board
            remote = tuple(u for _, u in handoff.k.remote)
            try:
                offer, arrays = self._pieces_offer(handoff, fields)
            except TransferError:
                board.reclaim(remote)
                raise
        elif isinstance(handoff.k, jax.Array) and isinstance(handoff.v, jax.Array):
            sums = ((page_checksums(handoff.k), page_checksums(handoff.v))
                    if self.options.checksums_on() else (None, None))
            offer = Offer(k=describe(handoff.k), v=describe(handoff.v), k_checksums=sums[0],
                          v_checksums=sums[1], **fields)
            arrays = [handoff.k, handoff.v]
        else:
            raise TypeError("send needs k and v as jax.Array on this process's devices")
        try:
            pack(offer.to_dict())
        except (TypeError, ValueError) as e:
            if board is not None:
                board.reclaim(remote)
            raise TypeError(f"payload of {handoff.request_id!r} must be msgpack-able "
                            f"(dicts, lists, str, numbers, bytes): {e}") from e
        self._wait_for_room()
        ttl = self.options.offer_ttl_s
        offer_arrays(self._server, uuid, arrays, ttl, self._server_expires_offers)
        with self._lock:
            self._pending[uuid] = _Pending(tuple(arrays), time.monotonic() + ttl, remote, board)
        try:
            client = self._client(self._destination(handoff))
            client.offer(offer, timeout=self.options.rpc_timeout_s)
        except TransferError:
            # Nobody will pull it: end the offer now rather than at its TTL.
            self._release(uuid, reclaim=True)
            raise

    def _pieces_offer(self, handoff: KVHandoff, fields: dict) -> tuple[Offer, list]:
        """The Offer of a handoff of `ShardedPages`: this process's piece (offered under
        the Offer's uuid) and each follower's, as it described it; and our arrays."""
        from jaxpd.engine.multihost.shard_offers import make_piece, whole_layout
        k, v = handoff.k.array, handoff.v.array
        whole = whole_layout(k), whole_layout(v)
        own, arrays = make_piece(self.transfer_address, fields["uuid"], k, v,
                                 self.options.checksums_on())
        pieces = [own] if own.heads else []
        pieces += [handoff.k.board.read(p, u, *whole) for p, u in handoff.k.remote]
        if not own.heads:         # this process owns no range (not how meshes are laid out)
            raise TransferError("the leader holds no kv-head range of its own to offer")
        return Offer(k=whole[0], v=whole[1], pieces=tuple(pieces), **fields), arrays

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
        first would hold it up."""
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

    def _release(self, uuid: int, reclaim: bool = False, pulled: tuple[int, ...] = ()) -> None:
        """Forget an offer; `reclaim`: nobody pulled it (of a pieces Offer: none but the
        pieces in `pulled`), so also end it in the server (which otherwise holds the
        pages until the offer's timeout, or for good on jax < 0.10.1), and have the
        followers end theirs."""
        with self._lock:
            pending = self._pending.pop(uuid, None)
            self._lock.notify_all()
        if not reclaim or pending is None:
            return
        if uuid not in pulled:
            self._reclaim_later(uuid, pending)
        remote = [u for u in pending.remote if u not in pulled]
        if remote and not self._closed:
            self._reclaimer.submit(pending.board.reclaim, remote)

    def _reclaim_later(self, uuid: int, pending: _Pending) -> None:
        if not self._closed:
            self._reclaimer.submit(self._reclaim, uuid, pending)

    def _reclaim(self, uuid: int, pending: _Pending) -> None:
        """End an offer by pulling it from our own server in its exact layout (a uuid
        can be pulled once); the copy is dropped at once. Under a short watchdog: if
        a peer's pull of it is stuck mid-way, we give up and say so."""
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                 for a in pending.arrays]
        try:
            reclaim_offer(self._server, uuid, specs, self.options.reclaim_timeout_s)
            self.reclaimed += 1
        except Exception as e:  # noqa: BLE001 -- best effort: a peer may have pulled it after all
            _log.warning("could not end offer %d in the transfer server (%s); its pages stay "
                         "there until the offer's timeout or the process exits", uuid, e)

    def _on_ack(self, ack: Ack) -> None:
        if ack.error and not ack.error.startswith("discarded"):
            _log.warning("decode side failed to take offer %d: %s", ack.uuid, ack.error)
        # Pulled (even if the pages were then refused): the server has let go. Not
        # pulled (discarded, or the peer's pull failed): end the offer in the server too.
        self._release(ack.uuid, reclaim=bool(ack.error) and not ack.error.startswith(PULLED),
                      pulled=ack.pulled)

    def close(self) -> None:
        """Also drop the arrays of offers not yet acked."""
        with self._lock:
            self._pending.clear()
        super().close()
        self._reclaimer.shutdown(wait=True, cancel_futures=True)
