"""The leader-to-follower plan of a multi-process decode role
(`engine.multihost.decode`), over `test_plan_channel`'s in-memory store: a leader's
decode-runner calls replayed in order with the same arrays, page bytes sent only where
a follower needs them, every malformed field refused by name (PlanError), and the
host-built insert equal to the pages it was given."""
import threading
import types

import jax
import numpy as np
import pytest

from jaxpd.engine.multihost import decode as multihost_decode
from jaxpd.engine.multihost.plan_channel import Follower, PlanError
from jaxpd.engine.multihost.decode import DecodeReplay, LeaderDecodeRunner, insert_from_host
from jaxpd.engine.programs.sampler import SamplingArrays
from tests.support.plan_store import Store, pair

SLOTS, PAGES, WIDTH, VOCAB = 4, 8, 3, 50
POOL = (2, 2 * PAGES, 4, 1, 2)                    # [L, D * pages per shard, S, K, H]
CONFIG = types.SimpleNamespace(pages_per_slot=WIDTH, max_model_len=12, page_size=4)


class Device:
    def __init__(self, process_index):
        self.process_index = process_index


class Runner:
    """A 2-shard decode runner that records what it is asked to run. `processes`: each
    shard's devices' processes (default: shard 0 on process 0, shard 1 on process 1)."""

    def __init__(self, processes=((0,), (1,))):
        self.calls = []
        self.mesh = types.SimpleNamespace(
            devices=np.array([[Device(p) for p in shard] for shard in processes]))
        self.num_shards, self.pages_per_shard = 2, PAGES
        self.slots_per_shard = SLOTS // 2
        self.prev_tokens = np.zeros(SLOTS, np.int32)
        self.k_pool = np.zeros(POOL, np.float32)

    def every_slot(self):
        return np.tile(np.arange(self.slots_per_shard, dtype=np.int32), self.num_shards)

    def step(self, tokens, fed, positions, tables, sampling, rows):
        self.calls.append(("step", tokens.tolist(), fed.tolist(), positions.tolist(),
                           tables.tolist(), sampling.floats.tolist(), rows.tolist()))
        return np.zeros(SLOTS, np.int32), None

    def set_penalties(self, slot, prompt_ids, output_ids):
        self.calls.append(("penalties", slot, list(prompt_ids), list(output_ids)))

    def take(self, shard, page_ids):
        self.calls.append(("take", shard, list(page_ids)))
        return _pages(len(page_ids)) + shard, _pages(len(page_ids)) - shard


@pytest.fixture
def inserts(monkeypatch):
    """The host inserts made, instead of a device program; step outputs ungathered."""
    made = []
    monkeypatch.setattr(multihost_decode, "insert_from_host",
                        lambda runner, shard, ids, k, v, src=None: made.append(
                            (shard, ids, k, v, src)))
    monkeypatch.setattr(multihost_decode, "_gathered",
                        lambda runner, tree: jax.tree.map(jax.numpy.asarray, tree))
    return made


def _step_args(width=WIDTH):
    tables = np.zeros((SLOTS, width), np.int32)
    tables[1] = [3, 4, 5][:width]
    sampling = SamplingArrays.empty(SLOTS)
    sampling.temperature[2] = 0.7
    return (np.array([1, 2, 3, 4], np.int32), np.array([True, False, True, True]),
            np.array([0, 9, 1, 2], np.int32), tables, sampling)


def _pages(n):
    shape = (POOL[0], n) + POOL[2:]
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


def test_follower_replays_steps_inserts_and_penalties_and_pages_come_by_all_gather(inserts):
    """Each dp shard within one process: every insert's pages sit on the leader's shard
    0 and move by an all-gather; the plan carries only page ids."""
    store = Store()
    leader_ch, follower_ch = pair(store)
    lead = LeaderDecodeRunner(Runner(), leader_ch)
    lead.step(*_step_args())
    lead.insert(1, [7], _pages(1), _pages(1) + 1)        # the follower's shard
    lead.insert(0, [1, 2], _pages(2), _pages(2) + 1)     # the leader's
    assert leader_ch.sent_bytes < 1000
    lead.set_penalties(3, [4, 5], [6])
    leader_ch.publish({"op": "stop"})
    replay = DecodeReplay(Runner(), None, CONFIG, VOCAB, process=1)
    assert Follower(follower_ch).run(replay, threading.Event()) == "stopped"
    tokens, fed, positions, tables, sampling = _step_args()
    assert replay.runner.calls == [
        ("step", tokens.tolist(), fed.tolist(), positions.tolist(), tables.tolist(),
         sampling.floats.tolist(), [0, 1, 0, 1]),
        ("penalties", 3, [4, 5], [6])]
    leader_inserts, follower_inserts = inserts[:2], inserts[2:]
    assert [(a[0], a[1], a[4]) for a in leader_inserts] == [(1, [7], 0), (0, [1, 2], 0)]
    np.testing.assert_array_equal(leader_inserts[0][2], _pages(1))
    assert follower_inserts == [(1, [7], None, None, 0), (0, [1, 2], None, None, 0)]


def test_pages_for_a_shard_spanning_processes_travel_in_the_plan(inserts):
    """decode=1x2 across 2 processes (tp over them): no shard is the leader's alone, so
    the pages ride along in the plan to the follower, which holds half of the shard."""
    store = Store()
    leader_ch, follower_ch = pair(store)
    both = ((0, 1), (0, 1))
    lead = LeaderDecodeRunner(Runner(both), leader_ch)
    lead.insert(0, [1, 2], _pages(2), _pages(2) + 1)
    lead.insert(1, [7], _pages(1), _pages(1) + 1)
    assert leader_ch.sent_bytes > 2 * _pages(3).nbytes      # every page, k and v
    leader_ch.publish({"op": "stop"})
    replay = DecodeReplay(Runner(both), None, CONFIG, VOCAB, process=1)
    follower = Follower(follower_ch)
    assert follower.run(replay, threading.Event()) == "stopped"
    for shard, ids, k, v, src in inserts[2:]:            # the leader's come first
        assert src is None
        np.testing.assert_array_equal(k, _pages(len(ids)))
        np.testing.assert_array_equal(v, _pages(len(ids)) + 1)
    assert [(a[0], a[1]) for a in inserts[2:]] == [(0, [1, 2]), (1, [7])]
    assert follower.acked == 1                           # plans 0 and 1 done


def test_a_migration_cut_is_replayed_and_its_pages_come_back_to_the_leader(inserts):
    """A migration's take (`cut`): the follower dispatches the same take (and, in the
    real runner, the all-gather that brings the pages to the leader); the leader gets
    its own copy of the pages, whichever process holds the shard. Only ids travel."""
    store = Store()
    leader_ch, follower_ch = pair(store)
    lead = LeaderDecodeRunner(Runner(), leader_ch)
    k, v = lead.take(1, [5, 6])                       # the follower's shard
    np.testing.assert_array_equal(np.asarray(k), _pages(2) + 1)
    np.testing.assert_array_equal(np.asarray(v), _pages(2) - 1)
    assert leader_ch.sent_bytes < 200
    leader_ch.publish({"op": "stop"})
    replay = DecodeReplay(Runner(), None, CONFIG, VOCAB, process=1)
    assert Follower(follower_ch).run(replay, threading.Event()) == "stopped"
    assert replay.runner.calls == [("take", 1, [5, 6])]


def _packed(a):
    return [a.dtype.name, list(a.shape), a.tobytes()]


def _step(**fields):
    tokens, fed, positions, tables, sampling = _step_args()
    msg = {"op": "step", "tokens": _packed(tokens), "fed": _packed(fed),
           "positions": _packed(positions), "tables": _packed(tables),
           "floats": _packed(sampling.floats), "ints": _packed(sampling.ints),
           "rows": _packed(np.array([0, 1, 0, 2], np.int32))}     # 2: a padding row
    msg.update(fields)
    return msg


def _insert(**fields):
    msg = {"op": "insert", "shard": 1, "ids": [1, 2], "k": _packed(_pages(2)),
           "v": _packed(_pages(2))}
    msg.update(fields)
    return msg


@pytest.mark.parametrize("message,match", [
    ({"op": "extend"}, "op 'extend' is not one a decode leader sends"),
    ({"op": "run"}, "op 'run' is not one a decode leader sends"),  # no prefill of its own
    (_step(tokens=_packed(np.zeros(SLOTS + 1, np.int32))), "plan field tokens: expected int32"),
    (_step(rows=_packed(np.zeros(3, np.int32))), "plan field rows: 3 rows"),
    (_step(rows=_packed(np.full(SLOTS, 3, np.int32))), "rows: values outside"),
    (_step(tokens=_packed(np.full(SLOTS, VOCAB, np.int32))), "tokens: values outside"),
    (_step(positions=_packed(np.full(SLOTS, -1, np.int32))), "positions: values outside"),
    (_step(positions=_packed(np.full(SLOTS, 12, np.int32))), "positions: values outside"),
    (_step(tables=_packed(np.full((SLOTS, 2), PAGES, np.int32))), "tables: values outside"),
    (_step(tables=_packed(np.zeros((SLOTS, 0), np.int32))), "plan step: tables"),
    (_step(tables=_packed(np.zeros((SLOTS, WIDTH + 1), np.int32))), "plan step: tables"),
    (_step(tables=_packed(np.zeros(SLOTS, np.int32))), "plan field tables: expected int32"),
    (_step(fed=_packed(np.ones(SLOTS, np.int32))), "plan step"),
    (_step(floats=_packed(np.zeros((SLOTS, 5), np.float32))), "plan step"),
    (_step(ints=["int64", [SLOTS, 4], b"\0" * 8 * SLOTS * 4]), "plan field ints"),
    (_step(tokens=None), "plan field tokens: not an array"),
    (_insert(shard=2), "plan field shard"),
    (_insert(shard=True), "plan field shard"),
    (_insert(ids=[]), "plan field ids"),
    (_insert(ids=[0] * 4), "plan field ids: expected 1 to 3 page ids"),  # WIDTH 3
    (_insert(ids=[1, PAGES]), "plan field ids"),
    (_insert(ids=[1, -1]), "plan field ids"),
    (_insert(ids="12"), "plan field ids"),
    (_insert(k=None), "plan field k: not an array"),
    (_insert(src=1, k=None, v=None), "plan field src: the leader's shard"),  # its own
    (_insert(src=2, k=None, v=None), "plan field src"),
    (_insert(src=0), "plan field src: the leader's shard, and no pages with it"),
    (_insert(v=_packed(_pages(3))), "plan field v"),
    (_insert(k=_packed(_pages(2).reshape(2, 2, 2, 2, 2))), "plan field k: expected float32"),
    (_insert(k=_packed(_pages(2).astype(np.int32))), "plan field k: expected float32"),
    (_insert(k=["float32", [2, 1 << 20, 4, 1, 2], b""]), "plan field k"),
    ({"op": "penalties", "slot": SLOTS, "prompt": _packed(np.zeros(1, np.int32)),
      "output": _packed(np.zeros(1, np.int32))}, "plan field slot"),
    ({"op": "penalties", "slot": 0, "prompt": _packed(np.full(1, VOCAB, np.int32)),
      "output": _packed(np.zeros(1, np.int32))}, "prompt: values outside"),
    ({"op": "penalties", "slot": 0, "prompt": _packed(np.zeros(13, np.int32)),
      "output": _packed(np.zeros(1, np.int32))}, "plan field prompt"),
    # A migration's `cut` names a shard and its page ids, bounded like an insert's.
    ({"op": "cut", "shard": 2, "ids": [1]}, "plan field shard"),
    ({"op": "cut", "shard": -1, "ids": [1]}, "plan field shard"),
    ({"op": "cut", "shard": True, "ids": [1]}, "plan field shard"),
    ({"op": "cut", "ids": [1]}, "plan field shard"),
    ({"op": "cut", "shard": 0, "ids": []}, "plan field ids"),
    ({"op": "cut", "shard": 0, "ids": [0] * 4}, "plan field ids: expected 1 to 3 page ids"),
    ({"op": "cut", "shard": 0, "ids": [PAGES]}, "plan field ids"),
    ({"op": "cut", "shard": 0, "ids": [1.0]}, "plan field ids"),
    ({"op": "cut", "shard": 0, "ids": b"\x01"}, "plan field ids"),
])
def test_malformed_decode_plan_is_refused_by_name(message, match, inserts):
    store = Store()
    leader_ch, follower_ch = pair(store)
    leader_ch.publish(message)
    replay = DecodeReplay(Runner(), None, CONFIG, VOCAB, process=1)
    with pytest.raises(PlanError, match=match):
        Follower(follower_ch).run(replay, threading.Event())
    assert replay.runner.calls == [] and inserts == []          # refused before acting


def test_insert_from_host_writes_exactly_the_pages_on_their_shard(tiny_hf_model):
    """Single process, decode=2x2 (kv heads split over tp where they divide): each
    device's block is cut from the host pages, the other shard's left as it was; the
    same when the pages sit on shard 0 and an all-gather moves them (`src`). A
    migration's take gives them back whole on every device."""
    from jaxpd.llm import LLM

    llm = LLM(tiny_hf_model[0], mesh="prefill=1,decode=2x2", max_model_len=64,
              slots_per_shard=2, warmup=False)
    runner = llm.engine.decode_runner      # kept past the stop, which lets go of it
    llm.shutdown()
    pool = runner.k_pool
    shape = (pool.shape[0], 3) + pool.shape[2:]
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal(shape).astype(pool.dtype) for _ in range(2))
    insert_from_host(runner, 1, [5, 6, 2], k, v)
    got_k, got_v = jax.device_get(runner.take(1, [5, 6, 2]))
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    # A migration's take: the same pages, whole on every device (the leader's copy).
    cut = multihost_decode.gathered_take(runner, 1, [5, 6, 2])
    assert all(x.sharding.is_fully_replicated for x in cut)
    np.testing.assert_array_equal(np.asarray(cut[0].addressable_data(0)), k)
    np.testing.assert_array_equal(np.asarray(cut[1].addressable_data(3)), v)
    assert not np.asarray(runner.take(0, [5, 6, 2])[0]).any()
    assert not np.asarray(runner.take(1, [1, 3, 4])[0]).any()
    insert_from_host(runner, 1, [3, 4], k[:, :2], v[:, :2], src=0)
    got_k, got_v = jax.device_get(runner.take(1, [5, 6, 2, 3, 4]))
    np.testing.assert_array_equal(got_k, np.concatenate([k, k[:, :2]], axis=1))
    np.testing.assert_array_equal(got_v, np.concatenate([v, v[:, :2]], axis=1))
    assert not np.asarray(runner.take(0, [3, 4, 5, 6, 2])[0]).any()


def test_a_failed_program_on_a_leader_stops_the_role_with_its_first_line():
    """`PlanChannel.on_failure` on a leader (`serving.follower.mesh_failed`): after
    giving the follower watch its time to name a dead follower, the role stops with
    the error (here `lost` records instead of ending the process)."""
    from jaxpd.serving.follower import mesh_failed

    lost = []
    mesh_failed(lost.append, 0.0)(RuntimeError("Gloo AllGather failed: reset\ntraceback"))
    mesh_failed(lost.append, 0.0)(RuntimeError())
    assert lost == ["a program on its mesh failed (Gloo AllGather failed: reset)",
                    "a program on its mesh failed (RuntimeError())"]
