"""The leader-to-follower plan of a multi-process prefill role (`engine.multihost`),
over an in-memory stand-in for jax.distributed's key-value store: signed, checked,
replayed in order; forged or malformed plans refused by name; a silent follower
reported; the launcher's flags checked before jax starts."""
import re
import threading
import time

import msgpack
import numpy as np
import pytest
from absl import flags

from jaxpd.engine.multihost.plan_channel import (Follower, FollowerWatch, PlanChannel, PlanError,
                                                 ProcessGroup)
from jaxpd.engine.multihost.prefill import LeaderPrefillRunner, PrefillReplay
from jaxpd.engine.programs.sampler import SamplingArrays
from jaxpd.serving.launch_flags import define_flags, multihost_error
from tests.support.plan_store import TOKEN, Store, pair


class Recorder:
    """A prefill runner that records what it is asked to run."""

    def __init__(self):
        self.calls = []

    def run(self, tokens, lengths, sampling):
        self.calls.append(("run", tokens.tolist(), lengths.tolist(), sampling.floats.tolist()))
        return np.zeros(len(lengths), np.int32), None, "k", "v"

    def take_rows(self, k, v, rows):
        self.calls.append(("take", k, v, rows))
        return [(np.zeros(1), np.zeros(1)) for _ in rows]


def _batch(b=2, t=8):
    tokens = np.arange(b * t, dtype=np.int32).reshape(b, t)
    return tokens, np.full(b, t, np.int32), SamplingArrays.empty(b)


class _Local:
    """A stand-in for a replicated jax array: `_local` takes its shard 0."""
    def addressable_data(self, i):
        return ("local", i)


def test_follower_replays_the_leaders_calls_in_order_and_stops_when_told():
    store = Store()
    leader_ch, follower_ch = pair(store)
    leader_runner, follower_runner = Recorder(), Recorder()
    leader_runner.take_rows = lambda k, v, rows: [(_Local(), _Local()) for _ in rows]
    lead = LeaderPrefillRunner(leader_runner, leader_ch)
    tokens, lengths, sampling = _batch()
    sampling.temperature[1] = 0.5
    _, _, k, v = lead.run(tokens, lengths, sampling)
    assert lead.take_rows(k, v, [(1, 1, 2), (0, 0, 3)]) == [(("local", 0), ("local", 0))] * 2
    assert lead.take_rows(k, v, []) == []                 # nothing to cut: nothing sent
    leader_ch.publish({"op": "stop"})
    follower = Follower(follower_ch)
    assert follower.run(PrefillReplay(follower_runner), threading.Event()) == "stopped"
    assert follower_runner.calls == [
        ("run", tokens.tolist(), lengths.tolist(), sampling.floats.tolist()),
        ("take", "k", "v", [(1, 1, 2), (0, 0, 3)])]
    assert follower.acked == 1
    assert leader_ch.sent_messages == 3 and leader_ch.sent_bytes > tokens.nbytes
    assert "3 messages" in leader_ch.summary()


def test_unsigned_or_wrongly_signed_plan_is_refused():
    store = Store()
    stranger, _ = pair(store, key=b"another-token-0123456789")
    _, follower_ch = pair(store)
    stranger.publish({"op": "stop"})
    with pytest.raises(PlanError, match="not signed with this role's cluster token"):
        follower_ch.receive(threading.Event())


def test_replayed_plan_under_another_number_is_refused():
    store = Store()
    leader_ch, follower_ch = pair(store)
    leader_ch.publish({"op": "stop"})
    store.key_value_set_bytes("jaxpd/plan/1", store.data["jaxpd/plan/0"])
    assert follower_ch.receive(threading.Event()) == {"op": "stop"}
    with pytest.raises(PlanError, match="plan 1 is not signed"):
        follower_ch.receive(threading.Event())


@pytest.mark.parametrize("message,match", [
    ({"op": "launch"}, "op 'launch' is not one a leader sends"),
    ({"op": "take", "rows": [[0, 0, 1]]}, "take before any run"),
    ({"op": "take", "rows": [[0, 0]]}, "take before any run"),
    ({"op": "run", "tokens": ["int64", [1], b"\0" * 8]}, "plan field tokens"),
    ({"op": "run", "tokens": ["int32", [2, 2], b"\0" * 4]}, "4 bytes do not make int32"),
    ({"op": "run", "tokens": ["int32", [1 << 20, 1 << 20], b""]}, "plan field tokens"),
    ({"op": "run", "tokens": ["int32", [1, 2], b"\0" * 8], "lengths": ["int32", [3], b"\0" * 12],
      "floats": ["float32", [1, 6], b"\0" * 24], "ints": ["int32", [1, 4], b"\0" * 16]},
     "plan batch"),
])
def test_malformed_plan_is_refused_by_name(message, match):
    store = Store()
    leader_ch, follower_ch = pair(store)
    leader_ch.publish(message)
    with pytest.raises(PlanError, match=match):
        Follower(follower_ch).run(PrefillReplay(Recorder()), threading.Event())


@pytest.mark.parametrize("rows,match", [([[0, 0]], "lists of 3"), ([[0, -1, 1]], "lists of 3"),
                                        ([[0, 0, 0]], "at least one page"),
                                        ([[0, True, 1]], "lists of 3"), ("rows", "lists of 3")])
def test_malformed_take_after_a_run_is_refused_by_name(rows, match):
    store = Store()
    leader_ch, follower_ch = pair(store)
    LeaderPrefillRunner(Recorder(), leader_ch).run(*_batch())
    leader_ch.publish({"op": "take", "rows": rows})
    with pytest.raises(PlanError, match=match):
        Follower(follower_ch).run(PrefillReplay(Recorder()), threading.Event())


def test_undecodable_plan_is_refused():
    store = Store()
    _, follower_ch = pair(store, key=None)
    store.key_value_set_bytes("jaxpd/plan/0", b"\xc1 not msgpack")
    with pytest.raises(PlanError, match="does not decode"):
        follower_ch.receive(threading.Event())
    store.key_value_set_bytes("jaxpd/plan/0", msgpack.packb([1, 2]), allow_overwrite=True)
    with pytest.raises(PlanError, match="has no op"):
        follower_ch.receive(threading.Event())


def test_receive_returns_none_once_stopped():
    stop = threading.Event()
    _, follower_ch = pair(Store())
    threading.Timer(0.1, stop.set).start()
    assert follower_ch.receive(stop, poll_ms=20) is None


def test_plans_every_follower_finished_are_deleted_from_the_store():
    store = Store()
    leader_ch, follower_ch = pair(store)
    for i in range(3 * PlanChannel.WINDOW):
        leader_ch.publish({"op": "noop", "i": i})
        if i == 2 * PlanChannel.WINDOW - 1:
            follower_ch.beat(0, 2 * PlanChannel.WINDOW - 1)
    leader_ch.publish({"op": "stop"})
    kept = sorted(int(k.rsplit("/", 1)[1]) for k in store.data if k.startswith("jaxpd/plan/"))
    assert kept[0] == 2 * PlanChannel.WINDOW and kept[-1] == 3 * PlanChannel.WINDOW


def test_watch_reports_a_follower_that_stops_beating():
    store = Store()
    leader_ch, follower_ch = pair(store)
    follower = Follower(follower_ch).start()
    lost = []
    watch = FollowerWatch(leader_ch, lost.append, dead_s=1.0)
    time.sleep(1.5)
    assert lost == []                                  # beating: alive
    follower.close()
    deadline = time.monotonic() + 10
    while not lost:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    watch.stop()
    assert len(lost) == 1 and "follower process 1 has not answered" in lost[0]


def test_watch_reports_a_follower_that_is_behind_and_stuck():
    store = Store()
    leader_ch, follower_ch = pair(store)
    leader_ch.publish({"op": "noop"})
    follower = Follower(follower_ch).start()            # beats, never acks plan 0
    lost = []
    watch = FollowerWatch(leader_ch, lost.append, dead_s=5.0, stuck_s=1.0)
    deadline = time.monotonic() + 10
    while not lost:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    watch.stop()
    follower.close()
    assert "follower process 1 is 1 plans behind" in lost[0]


@pytest.fixture
def fv():
    values = flags.FlagValues()
    define_flags(values)
    values(["launch"])
    return values


@pytest.mark.parametrize("args,match", [
    ({"process_id": 1}, "--process_id needs --num_processes > 1"),
    ({"num_processes": 2, "role": ""}, "only a prefill or decode role spans processes"),
    ({"num_processes": 2, "role": "decode", "mesh": "prefill=2", "coordinator": "127.0.0.1:9"},
     "a decode role across processes has one mesh"),
    ({"num_processes": 2, "role": "decode", "mesh": "elastic=4", "coordinator": "127.0.0.1:9"},
     "a decode role across processes has one mesh"),
    ({"num_processes": 2, "role": "prefill", "mesh": "colocated=2",
      "coordinator": "127.0.0.1:9"}, "a prefill role across processes has one mesh"),
    ({"num_processes": 2, "role": "decode", "coordinator": "127.0.0.1:9"},
     "needs an explicit --mesh decode=D or decode=DxT"),
    ({"num_processes": 2, "role": "decode", "mesh": "decode=3", "coordinator": "127.0.0.1:9"},
     "cannot share equally"),
    ({"num_processes": 2, "role": "decode", "mesh": "decode=2", "coordinator": "127.0.0.1:9",
      "enable_prefix_caching": True}, "--enable_prefix_caching is not supported yet on a "
     "decode role"),
    ({"num_processes": 2, "role": "prefill", "process_id": 2, "coordinator": "127.0.0.1:9"},
     "--process_id must be below"),
    ({"num_processes": 2, "role": "prefill", "mesh": "prefill=4"},
     "--coordinator must be host:port"),
    ({"num_processes": 2, "role": "prefill", "coordinator": "127.0.0.1:9"},
     "--num_processes > 1 needs an explicit --mesh prefill=P"),
    ({"num_processes": 3, "role": "prefill", "mesh": "prefill=4", "coordinator": "127.0.0.1:9"},
     "cannot share equally"),
    ({"num_processes": 2, "role": "prefill", "mesh": "prefill=4", "coordinator": "10.1.2.3:9"},
     "beyond loopback: give the cluster token"),
    ({"num_processes": 2, "role": "prefill", "mesh": "prefill=4", "coordinator": "127.0.0.1:9",
      "enable_prefix_caching": True}, "--enable_prefix_caching is not supported yet"),
])
def test_launcher_refuses_bad_multi_process_flags(fv, args, match, monkeypatch):
    monkeypatch.delenv("JAXPD_CLUSTER_TOKEN", raising=False)
    for name, value in args.items():
        fv[name].value = value
    assert match in multihost_error(fv)


def test_launcher_accepts_a_signed_coordinator_beyond_loopback(fv, monkeypatch):
    monkeypatch.setenv("JAXPD_CLUSTER_TOKEN", TOKEN.decode())
    fv.num_processes, fv.role, fv.mesh, fv.coordinator = 2, "prefill", "prefill=4", "10.1.2.3:9"
    assert multihost_error(fv) is None


def test_follower_of_another_checkpoint_refuses_to_join_and_says_so():
    """Followers 1 (the leader's checkpoint) and 2 (another): 1 joins; 2 and the leader
    both refuse, each naming both fingerprints."""
    store = Store()
    leader, same, other = (PlanChannel(ProcessGroup(3, pid, "127.0.0.1:1"), TOKEN,
                                       client=store) for pid in (0, 1, 2))
    errors = {}

    def join(channel, fingerprint, name):
        try:
            channel.check_model(fingerprint, timeout_s=5)
        except PlanError as e:
            errors[name] = str(e)
    threads = [threading.Thread(target=join, args=(same, "a" * 64, "same")),
               threading.Thread(target=join, args=(other, "b" * 64, "other"))]
    for t in threads:
        t.start()
    join(leader, "a" * 64, "leader")
    for t in threads:
        t.join(5)
    assert "same" not in errors and errors.keys() == {"other", "leader"}
    assert re.search(r"refusing to join: this follower's checkpoint differs from its "
                     r"leader's \(model fingerprint b{12}, the leader's a{12}\)", errors["other"])
    assert "follower process 2's checkpoint differs from this leader's" in errors["leader"]
    # A fingerprint not signed with the role's token is no leader's.
    store.key_value_set_bytes("jaxpd/model/0", b"\0" * 32 + b"b" * 64, allow_overwrite=True)
    with pytest.raises(PlanError, match="not signed"):
        other.check_model("b" * 64)
    lonely = PlanChannel(ProcessGroup(2, 1, "127.0.0.1:1"), TOKEN, client=Store())
    with pytest.raises(PlanError, match="process 0 published no model fingerprint"):
        lonely.check_model("a" * 64, timeout_s=0.05)
