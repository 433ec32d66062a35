"""Per-shard KV offers (`engine.multihost.shard_offers`), in one process: which process owns which
kv heads, the Offer's pieces and their checks, a follower's piece through the
coordination store (signed), the decode side joining pieces, and what is ended when
nobody pulls. Across real processes: `test_multihost`."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.multihost import shard_offers
from jaxpd.engine.multihost.plan_channel import PlanChannel, PlanError, ProcessGroup
from jaxpd.engine.multihost.prefill import PrefillReplay, _base
from jaxpd.transfer import jax_compat
from jaxpd.transfer.checksum import ChecksumMismatchError, page_checksums
from jaxpd.transfer.connector import KVHandoff
from jaxpd.transfer.control import Ack, ControlClient, ControlServer, Offer, Piece
from jaxpd.transfer.layout import describe
from jaxpd.transfer.transfer_server import (PULLED, PullTimeoutError, TransferServerOptions,
                                            TransferServerReceiver, TransferServerSender)
from jaxpd.transfer.wire import TransferError

SHAPE = (2, 3, 4, 4, 8)            # L, P, S, K, H
pytestmark = pytest.mark.skipif(not jax_compat.await_pull_takes_timeout(),
                                reason="per-shard offers need await_pull(timeout=)")


class Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        self.data[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        while key not in self.data:
            if time.monotonic() > deadline:
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            time.sleep(0.01)
        return self.data[key]

    def key_value_try_get_bytes(self, key):
        return self.data[key]

    def key_value_delete(self, key):
        self.data.pop(key, None)

    def plans(self) -> list[dict]:
        import msgpack
        return [msgpack.unpackb(v[32:], raw=False) for k, v in sorted(self.data.items())
                if k.startswith("jaxpd/plan/")]


def channel(store: Store, token: bytes | None = b"token", process_id: int = 0):
    return PlanChannel(ProcessGroup(2, process_id, "127.0.0.1:1"), token, client=store)


def pages(scale: float = 1.0) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1) * scale


def on_tp(x: np.ndarray, tp: int = 4, spec=P(None, None, None, "tp")) -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    return jax.device_put(x, NamedSharding(mesh, spec))


def target() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[4:6]), ("tp",)), P(None, None, None, "tp"))


OPTIONS = TransferServerOptions(pull_timeout_s=5.0, rpc_timeout_s=5.0, verify_checksums=True,
                                offer_ttl_s=30.0)


@pytest.fixture
def receiver():
    r = TransferServerReceiver(options=OPTIONS)
    yield r
    r.close()


@pytest.fixture
def acks():
    """A control server taking Acks (where a hand-made Offer's ack goes)."""
    got: list[Ack] = []
    server = ControlServer("127.0.0.1:0", on_ack=got.append)
    yield server.address, got
    server.stop()


def test_owned_ranges_cover_every_kv_head_once_and_local_pieces_hold_them():
    k = on_tp(pages())
    assert shard_offers.owned(k) == [(0, 1, 0), (1, 2, 0), (2, 3, 0), (3, 4, 0)]
    parts = shard_offers.local_pieces(k)
    assert [h for h, _ in parts] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for (start, stop), a in parts:
        np.testing.assert_array_equal(np.asarray(a), pages()[:, :, :, start:stop])
    # Replicated kv heads (fewer than tp): one range, offered once.
    replicated = on_tp(pages(), spec=P())
    assert shard_offers.owned(replicated) == [(0, 4, 0)]
    assert [h for h, _ in shard_offers.local_pieces(replicated)] == [(0, 4)]
    assert shard_offers.remote_owners(k) == []


def test_piece_uuids_are_derived_alike_and_differ_by_group_row_and_process():
    uuids = {shard_offers.piece_uuid(7, g, r, p) for g in range(3) for r in range(4)
             for p in range(2)}
    assert len(uuids) == 24 and all(0 <= u < 1 << 63 for u in uuids)
    assert shard_offers.piece_uuid(7, 1, 2, 1) == shard_offers.piece_uuid(7, 1, 2, 1)


def test_leader_offers_sharded_pages_as_pieces_and_the_decode_side_joins_them(receiver):
    store = Store()
    sender = TransferServerSender(decode_control_address=receiver.control_address,
                                  options=OPTIONS)
    try:
        board = shard_offers.Board(channel(store))
        (k, v), = board.wrap(5, 0, [(on_tp(pages()), on_tp(-pages()))])
        sender.send(KVHandoff("r", 40, 3, k, v))
        handoff = receiver.receive(timeout=5)
        piece, = handoff.offer.pieces
        assert piece.heads == ((0, 1), (1, 2), (2, 3), (3, 4))
        assert handoff.k.shape == SHAPE
        k_placed, v_placed, stats = receiver.place(handoff, target())
        np.testing.assert_array_equal(np.asarray(k_placed), pages())
        np.testing.assert_array_equal(np.asarray(v_placed), -pages())
        assert stats.num_bytes == 2 * pages().nbytes
        assert receiver.counts() == {"kv_pieces_pulled": 1}
        deadline = time.monotonic() + 5
        while sender.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.pending() == 0 and sender.reclaimed == 0
    finally:
        sender.close()


def test_a_followers_piece_reaches_the_offer_through_the_store_signed(receiver, acks):
    store = Store()
    offerer = shard_offers.Offerer(channel(store, process_id=1), OPTIONS)
    k, v = on_tp(pages()), on_tp(-pages())
    offerer.offer(11, 0, [(k, v)])
    uuid = shard_offers.piece_uuid(11, 0, 0, jax.process_index())
    whole = shard_offers.whole_layout(k), shard_offers.whole_layout(v)
    # Another token cannot read it (nor could it have written it).
    with pytest.raises(TransferError, match="not signed"):
        shard_offers.Board(channel(store, token=b"other")).read(1, uuid, *whole)
    store.data.clear()
    offerer.offer(11, 0, [(k, v)])      # offered again (the first was never pulled)
    piece = shard_offers.Board(channel(store)).read(1, uuid, *whole)
    assert f"jaxpd/piece/{uuid}" not in store.data           # read once, then deleted
    assert piece.transfer_address == offerer.address
    address, got = acks
    offer = Offer(uuid=uuid, request_id="f", num_tokens=40, first_token=1, k=whole[0],
                  v=whole[1], transfer_address=offerer.address, ack_address=address,
                  pieces=(piece,))
    ControlClient(receiver.control_address).offer(offer, timeout=5)
    k_placed, _, _ = receiver.place(receiver.receive(timeout=5), target())
    np.testing.assert_array_equal(np.asarray(k_placed), pages())
    assert offerer.offered_pieces == 2 and "offered 2 KV pieces" in offerer.summary()
    # Not offered in time: a TransferError naming the follower, not a hang.
    with pytest.raises(TransferError, match="follower process 1 did not offer"):
        shard_offers.Board(channel(store), timeout_s=0.2).read(1, 12345, *whole)


def _offer(pieces, ack_address, k=None):
    k = k or shard_offers.whole_layout(on_tp(pages()))
    return Offer(uuid=pieces[0].uuid, request_id="p", num_tokens=40, first_token=1, k=k, v=k,
                 transfer_address=pieces[0].transfer_address, ack_address=ack_address,
                 pieces=tuple(pieces))


def _piece(uuid, heads, address="127.0.0.1:9", sums=False):
    layout = lambda h: describe(on_tp(pages()[:, :, :, h[0]:h[1]].copy(), tp=1))
    checks = tuple(page_checksums(pages()[:, :, :, a:b]) for a, b in heads) if sums else None
    return Piece(address, uuid, tuple(heads), tuple(map(layout, heads)),
                 tuple(map(layout, heads)), checks, checks)


@pytest.mark.parametrize("heads, error", [
    ([[(0, 2)], [(1, 4)]], "cover"),             # overlap
    ([[(0, 1)], [(2, 4)]], "cover"),             # gap
    ([[(0, 2)]], "cover"),                       # short
    ([[(0, 2), (2, 5)]], "not a head range"),    # past K
])
def test_an_offer_whose_pieces_do_not_tile_the_kv_heads_is_refused(heads, error):
    pieces = [_piece(i + 1, hs) for i, hs in enumerate(heads)]
    with pytest.raises(ValueError, match=error):
        Offer.from_dict(_offer(pieces, "127.0.0.1:1").to_dict())


def test_offer_and_ack_round_trip_with_pieces_and_bad_fields_are_refused():
    offer = _offer([_piece(1, [(0, 2)], sums=True), _piece(2, [(2, 4)])], "127.0.0.1:1")
    assert Offer.from_dict(offer.to_dict()) == offer
    d = offer.to_dict()
    d["pieces"][0]["k_checksums"] = [[1, 2]]                 # 2 sums for 3 pages
    with pytest.raises(ValueError, match="one value per page"):
        Offer.from_dict(d)
    with pytest.raises(ValueError, match="at most 64"):
        Offer.from_dict(dict(offer.to_dict(), pieces=[offer.to_dict()["pieces"][0]] * 65))
    ack = Ack(5, "x", pulled=(1, 2))
    assert Ack.from_dict(ack.to_dict()) == ack
    with pytest.raises(ValueError, match="pulled"):
        Ack.from_dict(dict(ack.to_dict(), pulled="all"))


def test_a_piece_from_another_host_is_refused_unless_that_host_is_named(receiver, acks):
    address, _ = acks
    offer = _offer([_piece(1, [(0, 2)], "127.0.0.1:9"), _piece(2, [(2, 4)], "10.9.9.9:9")],
                   address)
    with pytest.raises(TransferError, match="kv_offer_hosts"):
        ControlClient(receiver.control_address).offer(offer, timeout=5)
    named = TransferServerReceiver(options=TransferServerOptions(offer_hosts=("10.9.9.9",)))
    try:
        ControlClient(named.control_address).offer(offer, timeout=5)
        assert named.receive(timeout=5).offer == offer
    finally:
        named.close()


def test_damaged_and_missing_pieces_fail_the_handoff_and_say_which_were_pulled(receiver, acks):
    address, got = acks
    store = Store()
    offerer = shard_offers.Offerer(channel(store, process_id=1), OPTIONS)
    k = on_tp(pages())
    whole = shard_offers.whole_layout(k)
    offerer.offer(3, 0, [(k, on_tp(-pages()))])
    real = shard_offers.Board(channel(store)).read(1, shard_offers.piece_uuid(
        3, 0, 0, jax.process_index()), whole, whole)
    # Its bytes do not match the checksums the Offer carries: nothing is placed, and
    # the Ack says the pull completed (nothing to end).
    forged = Piece(real.transfer_address, real.uuid, real.heads, real.k, real.v,
                   tuple((0,) * 3 for _ in real.heads), real.v_checksums)
    ControlClient(receiver.control_address).offer(_offer([forged], address, whole), timeout=5)
    with pytest.raises(ChecksumMismatchError):
        receiver.place(receiver.receive(timeout=5), target())
    # A piece that never comes: the others' pulls are reported, the missing one is not.
    offerer.offer(4, 0, [(k, on_tp(-pages()))])
    first = shard_offers.Board(channel(store)).read(1, shard_offers.piece_uuid(
        4, 0, 0, jax.process_index()), whole, whole)
    half = Piece(first.transfer_address, first.uuid, first.heads[:2], first.k[:2],
                 first.v[:2], first.k_checksums[:2], first.v_checksums[:2])
    missing = _piece(99, [(2, 4)], first.transfer_address)
    quick = TransferServerReceiver(options=TransferServerOptions(pull_timeout_s=0.5))
    try:
        ControlClient(quick.control_address).offer(_offer([half, missing], address, whole),
                                                   timeout=5)
        with pytest.raises((PullTimeoutError, TransferError)):
            quick.place(quick.receive(timeout=5), target())
        deadline = time.monotonic() + 10          # acks are sent asynchronously
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        quick.close()
    assert got[0].error.startswith(PULLED) and got[0].pulled == (real.uuid,)
    assert not got[1].error.startswith(PULLED) and got[1].pulled == (first.uuid,)


def test_a_discarded_offer_has_its_followers_pieces_ended_through_the_plan(receiver):
    store = Store()
    sender = TransferServerSender(decode_control_address=receiver.control_address,
                                  options=OPTIONS)
    follower = shard_offers.Offerer(channel(store, process_id=1), OPTIONS)
    try:
        k, v = on_tp(pages()), on_tp(-pages())
        follower.offer(9, 0, [(k, v)])
        remote = shard_offers.piece_uuid(9, 0, 0, jax.process_index())
        board = shard_offers.Board(channel(store))
        # A leader whose own piece and a follower's both hold every kv head (one
        # process plays both here): the decode side refuses the Offer, and the
        # sender ends its own piece and, through the plan, the follower's.
        pair = [shard_offers.ShardedPages(x, ((1, remote),), board) for x in (k, v)]
        with pytest.raises(TransferError, match="cover"):
            sender.send(KVHandoff("d", 40, 1, *pair))
        deadline = time.monotonic() + 10
        while ({"op": "reclaim", "uuids": [remote]} not in store.plans() or
               sender.reclaimed < 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"op": "reclaim", "uuids": [remote]} in store.plans() and sender.reclaimed == 1
        PrefillReplay(None, follower)({"op": "reclaim", "uuids": [remote]})
        assert follower.reclaimed == 1
        # A plain discard: the decode side never pulls, the sender ends its own.
        (k2, v2), = board.wrap(10, 0, [(k, v)])
        sender.send(KVHandoff("e", 40, 1, k2, v2))
        receiver.discard(receiver.receive(timeout=5))
        while sender.reclaimed < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.reclaimed == 2 and sender.pending() == 0
    finally:
        sender.close()


def test_plan_fields_of_per_shard_offers_are_checked():
    replay = PrefillReplay(None, offers=object())
    with pytest.raises(PlanError, match="uuids"):
        replay({"op": "reclaim", "uuids": [-1]})
    with pytest.raises(PlanError, match="uuids"):
        replay({"op": "reclaim", "uuids": "all"})
    for bad in (None, -1, 1 << 63, True, "7"):
        with pytest.raises(PlanError, match="base"):
            _base({"base": bad})
    assert _base({"base": 7}) == 7
    with pytest.raises(PlanError, match="not one a leader sends"):
        PrefillReplay(None)({"op": "reclaim", "uuids": []})
