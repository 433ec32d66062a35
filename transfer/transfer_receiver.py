"""The decode side of the transfer-server connector (`TransferServerReceiver`): Offers
arrive on its control server, `place` pulls the pages from the sender's transfer server
(every piece of a pieces Offer, each from its owner) and reshards them. The protocol is
described in `transfer.transfer_server`.
"""
from __future__ import annotations

import dataclasses
import queue
import time

import jax
import numpy as np

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.transfer.checksum import check_page_checksums
from jaxpd.transfer.connector import KVHandoff, TransferStats, next_or_none
from jaxpd.transfer.control import (Ack, BackpressureError, Offer, Piece, address_is_on,
                                    address_on_any, peer_ip)
from jaxpd.transfer.endpoint import PULLED, Endpoint, TransferServerOptions, wait_ready
from jaxpd.transfer.layout import ArrayLayout, check_layout, describe, shape_dtype_struct
from jaxpd.transfer.wire import TransferError


@dataclasses.dataclass
class RemoteKVHandoff(KVHandoff):
    """A handoff whose pages still sit on the prefill side.

    `k` and `v` are `jax.ShapeDtypeStruct`s (shape and dtype only) until `place`.
    """
    offer: Offer = dataclasses.field(kw_only=True)

    @property
    def num_bytes(self) -> int:
        return self.offer.k.nbytes + self.offer.v.nbytes


class TransferServerReceiver(Endpoint):
    """`KVReceiver` from prefill sides in other processes or hosts: offers arrive on
    `control_address` and say where to pull from."""

    def __init__(self, *, control_address: str = "127.0.0.1:0",
                 options: TransferServerOptions = TransferServerOptions(),
                 auth: InternalAuth = NO_AUTH):
        self._queue: queue.Queue[RemoteKVHandoff] = queue.Queue(maxsize=options.max_pending)
        self.pieces_pulled = 0
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
            for piece in offer.pieces:       # or on a host named for the prefill mesh's others
                if not (address_is_on(piece.transfer_address, ip) or
                        address_on_any(piece.transfer_address, self.options.offer_hosts)):
                    raise ValueError(f"offer's piece at {piece.transfer_address!r} is neither "
                                     f"on the host it came from ({peer}) nor on one of "
                                     f"--kv_offer_hosts {list(self.options.offer_hosts)}")
        handoff = RemoteKVHandoff(
            request_id=offer.request_id, num_tokens=offer.num_tokens,
            first_token=offer.first_token, k=_struct(offer.k), v=_struct(offer.v),
            payload=offer.payload, part=offer.part, first_page=offer.first_page,
            fingerprint=offer.fingerprint, offer=offer)
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
        pulled: list[int] = []      # uuids whose pull completed
        try:
            if offer.pieces:
                k_raw, v_raw = self._pull_pieces(offer, pulled)
            else:
                k_raw, v_raw = self._pull(offer)
                pulled.append(offer.uuid)
                if self.options.checksums_on() and (offer.k_checksums, offer.v_checksums) != (
                        None, None):
                    self._verify(offer, k_raw, v_raw)
            k, v = jax.block_until_ready(jax.device_put((k_raw, v_raw), sharding))
        except Exception as e:
            every = len(pulled) == max(1, len(offer.pieces))
            self._ack(offer, error=(PULLED if every else "") + f"{type(e).__name__}: {e}",
                      pulled=tuple(pulled))
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"placing {offer.request_id!r} (uuid {offer.uuid}) failed: "
                                f"{type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        self._ack(offer)
        self.pieces_pulled += len(offer.pieces)
        return k, v, TransferStats(int(k.nbytes) + int(v.nbytes), seconds)

    def discard(self, handoff: RemoteKVHandoff) -> None:
        """Ack without pulling: the sender drops its arrays now instead of at the TTL."""
        self._check_open()
        self._ack(handoff.offer, error="discarded: request cancelled or superseded")

    def counts(self) -> dict[str, int]:
        return {"kv_pieces_pulled": self.pieces_pulled}

    def _pull(self, offer: Offer) -> tuple[jax.Array, jax.Array]:
        specs = [shape_dtype_struct(offer.k), shape_dtype_struct(offer.v)]
        # A fresh connection per pull (~1 ms) so that poisoning a stuck one fails
        # only this pull.
        connection = self._server.connect(offer.transfer_address)
        arrays = connection.pull(offer.uuid, specs)
        wait_ready(arrays, connection, self.options.pull_timeout_s,
                   f"pull of {offer.request_id!r} (uuid {offer.uuid}) from "
                   f"{offer.transfer_address}")
        try:
            k_raw, v_raw = jax.block_until_ready(arrays)
        except jax.errors.JaxRuntimeError as e:
            raise TransferError(f"pull of {offer.request_id!r} (uuid {offer.uuid}) from "
                                f"{offer.transfer_address} failed: {e}") from e
        check_layout(offer.k, describe(k_raw))
        check_layout(offer.v, describe(v_raw))
        return k_raw, v_raw

    def _pull_pieces(self, offer: Offer, pulled: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every piece from its owner, all pulls in flight at once, each checked against
        its layouts and checksums, then joined along the kv heads on the host (the
        pieces come from several processes: there is no one program to join them).
        Appends each completed pull's uuid to `pulled`."""
        what = f"pull of {offer.request_id!r} (uuid {offer.uuid})"
        pulls = []
        for piece in offer.pieces:
            connection = self._server.connect(piece.transfer_address)
            specs = [shape_dtype_struct(x) for x in piece.k + piece.v]
            pulls.append((piece, connection, connection.pull(piece.uuid, specs)))
        k_parts, v_parts = {}, {}
        for piece, connection, arrays in pulls:
            where = f"{what}: piece {piece.uuid} from {piece.transfer_address}"
            wait_ready(arrays, connection, self.options.pull_timeout_s, where)
            try:
                arrays = jax.block_until_ready(arrays)
            except jax.errors.JaxRuntimeError as e:
                raise TransferError(f"{where} failed: {e}") from e
            pulled.append(piece.uuid)
            n = len(piece.heads)
            for layout, array in zip(piece.k + piece.v, arrays):
                check_layout(layout, describe(array))
            self._verify_piece(piece, arrays[:n], arrays[n:], where)
            k_parts.update(zip(piece.heads, map(np.asarray, arrays[:n])))
            v_parts.update(zip(piece.heads, map(np.asarray, arrays[n:])))
        join = lambda parts: np.concatenate([parts[h] for h in sorted(parts)], axis=3)
        return join(k_parts), join(v_parts)

    def _verify_piece(self, piece: Piece, k: list, v: list, what: str) -> None:
        if not self.options.checksums_on() or (piece.k_checksums, piece.v_checksums) == (
                None, None):
            return
        if piece.k_checksums is None or piece.v_checksums is None:
            raise TransferError(f"{what}: the piece has checksums for only one of k and v")
        for name, arrays, sums in (("k", k, piece.k_checksums), ("v", v, piece.v_checksums)):
            for array, expected in zip(arrays, sums):
                check_page_checksums(name, array, expected, what)

    @staticmethod
    def _verify(offer: Offer, k: jax.Array, v: jax.Array) -> None:
        what = f"pull of {offer.request_id!r} (uuid {offer.uuid})"
        if offer.k_checksums is None or offer.v_checksums is None:
            raise TransferError(f"{what}: the Offer has checksums for only one of k and v")
        check_page_checksums("k", k, offer.k_checksums, what)
        check_page_checksums("v", v, offer.v_checksums, what)

    def _ack(self, offer: Offer, error: str = "", pulled: tuple[int, ...] = ()) -> None:
        self._client(offer.ack_address).ack(Ack(offer.uuid, error=error, pulled=pulled),
                                            timeout=self.options.rpc_timeout_s)


def _struct(layout: ArrayLayout) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(layout.shape, layout.dtype)
