"""Per-shard KV offers: a prefill mesh spanning processes hands the decode side each
process's own kv-head shards, not a gathered copy.

Without this, the take program of a mesh spanning processes all-gathers every row's
pages onto every device (a collective carrying the whole KV between the processes),
and the leader alone serves the decode side's pull. With it, the pages stay where the
prefill computed them -- split over kv heads, or replicated when those do not divide
tp -- and each distinct kv-head range is offered by the lowest-numbered process
holding it (`owned`), in that process's own transfer server. The leader's Offer
lists the pieces (`transfer.control.Piece`); the decode side pulls every piece from
its owner at once and joins them (`TransferServerReceiver`). Bytes moved are the
used pages exactly, as before; only who serves them changes.

How a follower's piece reaches the leader's Offer without a round trip per request:
each take (or layer-wise) plan message carries a fresh random `base`, and a piece's
uuid is derived from (base, layer group, row, process) on both sides (`piece_uuid`).
The follower offers its arrays under that uuid, then writes the piece's description
(its transfer address, head ranges, layouts, page checksums) to the coordination
service's store under `jaxpd/piece/<uuid>`, signed with the cluster token like the
plan; the leader's sender waits for it (`Board.read`), checks it, deletes it and
puts it in the Offer. A piece nobody pulled (the decode side discarded the Offer,
or failed) is ended by its owner: the leader says which through the plan
(`reclaim`). A description the leader never reads (its request was aborted between
the take and the send) is deleted by its follower after the offer's TTL, when the
transfer server has dropped the arrays too.

Chosen only for the transfer-server connector (`applies`): the gRPC stream sends
from the leader, and `kv_transfer_dtype` quantizes on the leader, so both keep the
gather.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

import jax
import msgpack

from jaxpd.transfer.checksum import page_checksums
from jaxpd.transfer.control import Piece
from jaxpd.transfer.endpoint import advertised, offer_arrays, reclaim_offer, start_transfer_server
from jaxpd.transfer.layout import ArrayLayout, describe
from jaxpd.transfer.wire import TransferError

_KEY = "jaxpd/piece/"
UUID_BITS = 63


def applies(transport: str, kv_transfer_dtype) -> bool:
    """Whether a prefill role's mesh spanning processes offers per shard: the
    transfer-server connector, no transfer quantization, a jax whose transfer server
    expires offers by itself (a follower keeps no reference to what it offered)."""
    from jaxpd.transfer import jax_compat
    return (transport == "transfer_server" and kv_transfer_dtype is None and
            jax_compat.await_pull_takes_timeout())


def piece_uuid(base: int, group: int, row: int, process: int) -> int:
    """The uuid of `process`'s piece of `row`'s pages (of layer group `group`) in the
    take whose plan message carried `base`: both sides derive it."""
    data = b"|".join(str(n).encode() for n in (base, group, row, process))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def owned(x: jax.Array) -> list[tuple[int, int, int]]:
    """(start, stop, owner process) of each distinct kv-head range of `x` [L, P, S, K, H]
    over its devices, in head order; the owner is the lowest process holding it."""
    ranges: dict[tuple[int, int], int] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        heads = index[3].indices(x.shape[3])[:2]
        ranges[heads] = min(ranges.get(heads, device.process_index), device.process_index)
    return sorted((start, stop, owner) for (start, stop), owner in ranges.items())


def local_pieces(x: jax.Array) -> list[tuple[tuple[int, int], jax.Array]]:
    """This process's own ranges of `x` (see `owned`): ((start, stop), the shard on
    one of its devices), in head order."""
    me = jax.process_index()
    mine = {(start, stop) for start, stop, owner in owned(x) if owner == me}
    out = {}
    for shard in x.addressable_shards:
        heads = shard.index[3].indices(x.shape[3])[:2]
        if heads in mine and heads not in out:
            out[heads] = shard.data
    return sorted(out.items(), key=lambda item: item[0])


def remote_owners(x: jax.Array) -> list[int]:
    """The other processes that own a range of `x`."""
    me = jax.process_index()
    return sorted({owner for _, _, owner in owned(x) if owner != me})


def make_piece(address: str, uuid: int, k: jax.Array, v: jax.Array,
               checksums: bool) -> tuple[Piece, list[jax.Array]]:
    """This process's piece of one row (`k`, `v` global [L, P, S, K, H]) and the arrays
    to offer under `uuid` (k's ranges, then v's)."""
    k_parts, v_parts = local_pieces(k), local_pieces(v)
    arrays = [a for _, a in k_parts] + [a for _, a in v_parts]
    sums = lambda parts: tuple(page_checksums(a) for _, a in parts) if checksums else None
    piece = Piece(address, uuid, tuple(h for h, _ in k_parts),
                  tuple(describe(a) for _, a in k_parts), tuple(describe(a) for _, a in v_parts),
                  sums(k_parts), sums(v_parts))
    return piece, arrays


def whole_layout(x: jax.Array) -> ArrayLayout:
    """What an Offer with pieces announces for `x`: its shape and dtype, on one device
    (the decode side joins the pieces on its side)."""
    return ArrayLayout(tuple(x.shape), jax.numpy.dtype(x.dtype).name, (1,), ("_single",),
                       (None,) * x.ndim, 1)


@dataclasses.dataclass(frozen=True)
class ShardedPages:
    """One row's k or v pages cut on a prefill mesh spanning processes, left where they
    were computed (a global array this process holds only part of). `remote`: the
    (process, uuid) of the followers' pieces of this row, k and v together; `board`
    reads their descriptions. What `KVHandoff.k` / `.v` carry on such a leader."""
    array: jax.Array
    remote: tuple[tuple[int, int], ...]
    board: Board

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)
    nbytes = property(lambda self: self.array.nbytes)

    def block_until_ready(self) -> ShardedPages:
        self.array.block_until_ready()
        return self


class Board:
    """The leader's side: read a follower's piece (`read`), end pieces nobody pulled
    (`reclaim`, through the plan)."""

    def __init__(self, channel, timeout_s: float = 30.0):
        self.channel, self.timeout_s = channel, timeout_s

    def wrap(self, base: int, group: int, pages: list) -> list:
        """`pages` (a take's (k, v) per row, global arrays) as `ShardedPages`."""
        out = []
        for row, (k, v) in enumerate(pages):
            remote = tuple((p, piece_uuid(base, group, row, p)) for p in remote_owners(k))
            out.append((ShardedPages(k, remote, self), ShardedPages(v, remote, self)))
        return out

    def read(self, process: int, uuid: int, k: ArrayLayout, v: ArrayLayout) -> Piece:
        """Follower `process`'s piece `uuid` (of whole arrays `k`, `v`), once it is
        offered; `TransferError` when it is not within `timeout_s`, or is not one that
        follower could send."""
        client, key = self.channel.client, f"{_KEY}{uuid}"
        try:
            data = client.blocking_key_value_get_bytes(key, int(self.timeout_s * 1000))
        except Exception as e:      # jax's runtime error: not there in time
            raise TransferError(f"follower process {process} did not offer its piece "
                                f"{uuid} within {self.timeout_s:.0f} s ({str(e)[:200]})") from e
        try:
            client.key_value_delete(key)
        except Exception:            # noqa: BLE001 -- gone already: nothing to clean
            pass
        try:
            body = self.channel.open(b"piece", uuid, data)     # PlanError: a ValueError
            piece = Piece.from_dict(msgpack.unpackb(body, raw=False))
            if piece.uuid != uuid:
                raise ValueError(f"it names uuid {piece.uuid}")
            piece.check(k, v)
        except (ValueError, TypeError, KeyError, TransferError, msgpack.UnpackException) as e:
            raise TransferError(f"follower process {process}'s piece {uuid} is refused: "
                                f"{e}") from e
        return piece

    def reclaim(self, uuids) -> None:
        """Tell the followers to end these offers of theirs (nobody will pull them)."""
        if uuids:
            self.channel.publish({"op": "reclaim", "uuids": [int(u) for u in uuids]})


class Offerer:
    """A follower's side: its own transfer server, where it offers its pieces of each
    row a take cut (`offer`), and ends those the leader says nobody will pull
    (`reclaim`)."""

    def __init__(self, channel, options):
        self.channel, self.options = channel, options
        self._server = start_transfer_server(options)
        self.address = advertised(self._server.address(), options.advertise_host)
        # uuid -> (expiry, the specs to reclaim it with): what may still be pulled.
        self._offered: collections.OrderedDict[int, tuple[float, list]] = \
            collections.OrderedDict()
        self.offered_pieces = self.offered_bytes = self.reclaimed = 0

    def offer(self, base: int, group: int, pages: list) -> None:
        """Offer this process's pieces of each row's (k, v) of one take."""
        me = jax.process_index()
        self._forget_expired()
        for row, (k, v) in enumerate(pages):
            if not any(owner == me for _, _, owner in owned(k)):
                continue
            uuid = piece_uuid(base, group, row, me)
            piece, arrays = make_piece(self.address, uuid, k, v, self.options.checksums_on())
            ttl = self.options.offer_ttl_s
            offer_arrays(self._server, uuid, arrays, ttl, expires=True)   # see `applies`
            self._offered[uuid] = (time.monotonic() + ttl, [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays])
            body = msgpack.packb(piece.to_dict(), use_bin_type=True)
            self.channel.client.key_value_set_bytes(
                f"{_KEY}{uuid}", self.channel.seal(b"piece", uuid, body))
            self.offered_pieces += 1
            self.offered_bytes += sum(int(a.nbytes) for a in arrays)

    def reclaim(self, uuids: list[int]) -> None:
        """End these offers by pulling them from our own server (a uuid can be pulled
        once), under a short watchdog; best effort."""
        for uuid in uuids:
            entry = self._offered.pop(uuid, None)
            if entry is None:
                continue
            try:
                reclaim_offer(self._server, uuid, entry[1], self.options.reclaim_timeout_s)
                self.reclaimed += 1
            except Exception:        # noqa: BLE001 -- pulled after all, or expired
                pass

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._offered and next(iter(self._offered.values()))[0] <= now:
            uuid, _ = self._offered.popitem(last=False)
            try:
                self.channel.client.key_value_delete(f"{_KEY}{uuid}")
            except Exception:        # noqa: BLE001 -- read (and deleted) by the leader
                pass

    def summary(self) -> str:
        return (f"offered {self.offered_pieces} KV pieces ({self.offered_bytes} bytes), "
                f"{self.reclaimed} ended unpulled")
