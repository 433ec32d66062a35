"""The decode loop on a numpy `FakeRunner`: admission, transfers (whole and layer-wise,
lost, late, superseded, misfit), preemption, aborts and page accounting, in ms."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.transfer.connector import KVHandoff, KVPart
from tests.fake_runner import FakeRunner, InlineExecutor, pages
from tests.support.decode_env import (LAYERS, MAX_MODEL_LEN, MAX_PAGES_PER_SLOT, PAGE_SIZE,
                                      VOCAB, assert_no_page_held, make, run)
from tests.support.stop_text import AbortingStopText



@pytest.fixture
def pool():
    return InlineExecutor()


def prefilled(env, rid: str, prompt_len: int, first: int, max_tokens: int) -> Request:
    """A request as the prefill loop leaves it: first token sampled, KV on its way."""
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    env.requests.submit(r)
    env.requests.prefill_inbox.get_nowait()
    r.transition(State.PREFILLING)
    r.append_token(first, time.perf_counter())
    r.transition(State.TRANSFERRING)
    return r


def handoff(r: Request, first: int, value: float = 1.0, part: KVPart | None = None,
            layers: int = LAYERS) -> KVHandoff:
    n = len(r.prompt_ids)
    kv = pages(layers, -(-n // PAGE_SIZE), value, PAGE_SIZE)
    return KVHandoff(r.request_id, n, first if part is None or part.is_last else -1, kv, -kv,
                     payload=r, part=part)


def remote_mirrors(env, firsts: list[int], prompt_len: int = 3, max_tokens: int = 4,
                   value=lambda i: 1.0) -> list[Request]:
    """One request per first token, each registered as the router's mirror and its
    handoff (first token `firsts[i]`, pages of `value(i)`) pushed as another process
    sends it."""
    mirrors = []
    for i, first in enumerate(firsts):
        wire = Request(f"remote-{i}", list(range(1, prompt_len + 1)),
                       SamplingParams(max_tokens=max_tokens)).to_wire()
        mirrors.append(Request.from_wire(wire))
        env.requests.register(mirrors[-1])
        kv = pages(LAYERS, -(-prompt_len // PAGE_SIZE), value(i), PAGE_SIZE)
        env.receiver.push(KVHandoff(f"remote-{i}", prompt_len, first, kv, kv, payload=wire))
    return mirrors


def test_tokens_count_on_from_each_first_token_and_pages_come_back(pool):
    env = make(pool)
    reqs = [prefilled(env, "a", 5, 100, 6), prefilled(env, "b", 9, 200, 6)]
    for r, first in zip(reqs, (100, 200)):
        env.receiver.push(handoff(r, first, value=first))
    run(env, lambda: all(r.is_final for r in reqs))
    assert reqs[0].output_ids == list(range(100, 106))
    assert reqs[1].output_ids == list(range(200, 206))
    assert all(r.finish_reason == "length" for r in reqs)
    counts = env.stats.snapshot()
    assert counts["transfers"] == 2 and counts["finished"] == 2
    assert counts["transfer_bytes"] == sum(h.num_bytes for h in env.receiver.placed)
    # Each request's pages hold its own KV: found in the pool where it was inserted.
    for (shard, ids), first in zip(env.runner.inserts, (100, 200)):
        assert np.all(env.runner.k_pool[:, ids] == first)
    assert_no_page_held(env)


def test_admission_is_fifo_and_waits_for_a_free_slot(pool):
    env = make(pool, slots=1)
    first, second = prefilled(env, "first", 3, 10, 3), prefilled(env, "second", 3, 50, 3)
    env.receiver.push(handoff(first, 10))
    env.receiver.push(handoff(second, 50))
    run(env, lambda: second.is_final)
    assert first.output_ids == [10, 11, 12] and second.output_ids == [50, 51, 52]
    assert second.timings.kv_ready > first.timings.finish
    assert len(env.runner.inserts) == 2
    assert_no_page_held(env)


def test_a_lost_layerwise_part_times_out_and_the_request_is_prefilled_again(pool):
    env = make(pool, part_timeout_s=0.05)
    r = prefilled(env, "lost", 6, 7, 4)
    env.receiver.push(handoff(r, 7, part=KVPart(stream=1, index=0, count=2, layer_start=0),
                              layers=1))
    run(env, lambda: r.state is State.WAITING)
    assert env.requests.prefill_inbox.get_nowait() is r
    assert env.stats.snapshot()["transfer_failures"] == 1
    assert env.runner.inserts == []            # never decoded from pages it lacks
    assert_no_page_held(env)


def test_a_part_out_of_order_fails_the_transfer(pool):
    env = make(pool)
    r = prefilled(env, "jumbled", 6, 7, 4)
    env.receiver.push(handoff(r, 7, part=KVPart(1, 0, 3, 0), layers=1))
    late = handoff(r, 7, part=KVPart(1, 2, 3, 1), layers=1)
    env.receiver.push(late)
    run(env, lambda: r.state is State.WAITING)
    assert any(h is late for h in env.receiver.discarded)
    assert env.stats.snapshot()["transfer_failures"] == 1
    assert_no_page_held(env)


def test_a_new_prefill_supersedes_a_half_received_layerwise_transfer(pool):
    env = make(pool)
    r = prefilled(env, "retried", 6, 9, 3)
    env.receiver.push(handoff(r, 9, value=1.0, part=KVPart(1, 0, 2, 0), layers=1))
    run(env, lambda: env.scheduler.slot_of(r) is not None)
    # The first prefill worker died; the router's retry arrives as a new stream.
    env.receiver.push(handoff(r, 9, value=2.0, part=KVPart(2, 0, 2, 0), layers=1))
    env.receiver.push(handoff(r, 9, value=2.0, part=KVPart(2, 1, 2, 1), layers=1))
    run(env, lambda: r.is_final)
    assert r.output_ids == [9, 10, 11]
    stale = handoff(r, 9, value=1.0, part=KVPart(1, 1, 2, 1), layers=1)   # the dead one's
    env.receiver.push(stale)
    run(env, lambda: any(h is stale for h in env.receiver.discarded))
    (_, ids), = env.runner.inserts
    assert np.all(env.runner.k_pool[:, ids] == 2.0)   # the retry's pages, not the dead one's
    assert env.stats.snapshot()["layerwise_transfers"] == 1
    assert_no_page_held(env)


def test_a_second_handoff_of_a_request_with_a_slot_is_dropped(pool):
    env = make(pool)
    r = prefilled(env, "twice", 5, 3, 3)
    env.receiver.push(handoff(r, 3))
    env.receiver.push(handoff(r, 3))
    run(env, lambda: r.is_final)
    assert r.output_ids == [3, 4, 5]
    assert len(env.runner.inserts) == 1 and len(env.receiver.discarded) == 1
    assert_no_page_held(env)


def test_running_out_of_pages_preempts_the_youngest_and_frees_its_pages(pool):
    env = make(pool, slots=2, pages_per_shard=5)        # 4 usable pages of 4 tokens
    old, young = prefilled(env, "old", 3, 100, 12), prefilled(env, "young", 3, 200, 12)
    young.timings.arrival = old.timings.arrival + 1
    env.receiver.push(handoff(old, 100))
    env.receiver.push(handoff(young, 200))
    run(env, lambda: young.state is State.WAITING)
    assert env.stats.snapshot()["preemptions"] == 1 and young.timings.num_preemptions == 1
    assert env.requests.prefill_inbox.get_nowait() is young
    held = sum(len(s.pages) for s in env.scheduler.slots if s is not None)
    assert env.scheduler.allocators[0].num_used == held
    run(env, lambda: old.is_final)
    assert old.output_ids == list(range(100, 112))
    assert_no_page_held(env)


def test_an_abort_mid_transfer_frees_the_slot_and_later_parts_are_discarded(pool):
    env = make(pool)
    r = prefilled(env, "cancelled", 6, 7, 4)
    env.receiver.push(handoff(r, 7, part=KVPart(5, 0, 2, 0), layers=1))
    run(env, lambda: env.scheduler.slot_of(r) is not None)
    assert env.requests.abort("cancelled", "client went away")
    run(env, lambda: env.loop.idle)
    later = handoff(r, 7, part=KVPart(5, 1, 2, 1), layers=1)
    env.receiver.push(later)
    run(env, lambda: any(h is later for h in env.receiver.discarded))
    assert r.state is State.ABORTED and r.abort_reason == "client went away"
    assert env.runner.inserts == []
    assert_no_page_held(env)


def test_pages_that_do_not_fit_fail_the_transfer_and_the_loop_lives(pool):
    env = make(pool)
    bad = prefilled(env, "bad", 5, 1, 2)
    packed = np.zeros((LAYERS, 2, PAGE_SIZE * 2 + 4), np.uint8)     # compressed rows
    env.receiver.push(KVHandoff("bad", 5, 1, packed, packed, payload=bad))
    run(env, lambda: bad.state is State.WAITING)
    good = prefilled(env, "good", 5, 40, 2)
    env.receiver.push(handoff(good, 40))
    run(env, lambda: good.is_final)
    assert good.output_ids == [40, 41]
    assert env.stats.snapshot()["transfer_failures"] == 1
    assert_no_page_held(env)


def test_a_request_from_another_process_learns_its_first_token_from_the_handoff(pool):
    env = make(pool, remote=True)
    wire = Request("remote", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3)).to_wire()
    mirror = Request.from_wire(wire)
    env.requests.register(mirror)
    kv = pages(LAYERS, 2, 1.0, PAGE_SIZE)
    env.receiver.push(KVHandoff("remote", 5, 61, kv, kv, payload=wire))
    run(env, lambda: mirror.is_final)
    assert mirror.output_ids == [61, 62, 63]
    assert mirror.timings.token_times[0] == mirror.timings.kv_ready   # streamed on decoding
    assert_no_page_held(env)


def test_a_remote_first_token_waits_in_the_stream_until_its_request_decodes(pool):
    """A handoff waiting for a slot has its first token recorded (it is the request's
    output) but not streamed: the stream's first gap must not hold the wait for a slot
    and the insert. It goes out, timed, when the request's KV is in place."""
    env = make(pool, slots=1, remote=True)
    mirrors = remote_mirrors(env, [10, 20])
    env.loop.iterate(receive_timeout=None)
    waiting = mirrors[1]
    assert env.scheduler.slot_of(waiting) is None and waiting.output_ids == [20]
    assert waiting.events.empty() and waiting.timings.token_times == []
    run(env, lambda: waiting.state is State.DECODING)
    assert waiting.events.get_nowait() == ([20], None)
    assert waiting.timings.token_times == [waiting.timings.kv_ready]
    run(env, lambda: all(m.is_final for m in mirrors))
    assert [m.output_ids for m in mirrors] == [[10, 11, 12, 13], [20, 21, 22, 23]]
    assert_no_page_held(env)


def test_a_first_token_streams_only_once_its_pages_are_in_the_pool(pool, monkeypatch):
    """The insert is dispatched, not done, when the loop moves on: the first token
    waits for it, so the gap before the second token is one step's."""
    from jaxpd.engine.loops import decode_loop
    env = make(pool, remote=True)
    [mirror] = remote_mirrors(env, [30])
    waits = []

    def block_until_ready(tree):
        waits.append((time.perf_counter(), list(mirror.timings.token_times),
                      env.runner.inserts[:]))
        return tree

    monkeypatch.setattr(decode_loop.jax, "block_until_ready", block_until_ready)
    run(env, lambda: mirror.is_final)
    [(waited_at, streamed, inserted)] = waits
    assert streamed == [] and len(inserted) == 1          # after the insert, before the token
    assert mirror.timings.token_times[0] == mirror.timings.kv_ready >= waited_at
    assert mirror.output_ids == [30, 31, 32, 33]
    assert_no_page_held(env)


def test_handoffs_from_another_process_are_pulled_before_they_have_a_slot(pool):
    """The prefill process serves the pull and waits for it before its next batch: a
    handoff waiting for a slot is pulled at once, onto shard 0, up to
    `max_prefetch` of them; admitted later, its pages are the ones inserted."""
    env = make(pool, slots=1, remote=True)
    env.loop.max_prefetch = 1
    mirrors = remote_mirrors(env, [10, 20, 30], prompt_len=5, max_tokens=3,
                             value=lambda i: float(i + 1))
    env.loop.iterate(receive_timeout=None)
    # remote-0 has the slot; remote-1 waits for it, already pulled; remote-2 waits unpulled.
    assert [h.request_id for h in env.receiver.placed] == ["remote-0", "remote-1"]
    assert env.scheduler.slot_of(mirrors[1]) is None
    run(env, lambda: all(m.is_final for m in mirrors))
    assert [m.output_ids for m in mirrors] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert [h.request_id for h in env.receiver.placed] == ["remote-0", "remote-1", "remote-2"]
    assert env.stats.snapshot()["transfers"] == 3
    assert_no_page_held(env)


def test_a_prefetched_handoff_whose_request_is_aborted_is_dropped(pool):
    env = make(pool, slots=1, remote=True)
    mirrors = remote_mirrors(env, [7, 7])
    env.loop.iterate(receive_timeout=None)
    assert len(env.receiver.placed) == 2                  # the second was prefetched
    env.requests.abort("remote-1", "cancelled")
    run(env, lambda: all(m.is_final for m in mirrors))
    assert mirrors[0].output_ids == [7, 8, 9, 10] and mirrors[1].finish_reason == "abort"
    assert len(env.runner.inserts) == 1
    assert_no_page_held(env)


def test_resubmitting_a_request_that_finished_meanwhile_is_a_no_op(pool):
    """A request preempted by a step's plan may finish with the token of the step still
    in flight (read back right after the plan): resubmitting it then must change
    nothing, not kill the decode thread (seen once in CI: finished -> waiting)."""
    env = make(pool)
    r = Request("done", [1, 2, 3], SamplingParams(max_tokens=1))
    env.requests.submit(r)
    env.requests.prefill_inbox.get_nowait()
    r.transition(State.PREFILLING)
    assert r.append_token(7, time.perf_counter())     # its first token was its last
    assert r.state is State.FINISHED
    assert env.requests.resubmit(r) is False
    assert r.state is State.FINISHED and env.requests.prefill_inbox.empty()


def test_race_an_abort_at_a_requests_last_token_leaves_the_others_decoding(pool):
    """A cancel from an RPC thread landing while the decode thread records the token
    that ends a request (here: completes its stop string) is a no-op; the loop lives on
    and the other request decodes to its end, where an illegal ABORTED -> FINISHED
    would kill the decode thread and with it every live request."""
    env = make(pool)
    a, b = prefilled(env, "a", 5, 100, 6), prefilled(env, "b", 9, 200, 6)
    stop = AbortingStopText(a, at=102, abort=lambda reason: env.requests.abort("a", reason))
    a._stop_text = stop
    for r, first in ((a, 100), (b, 200)):
        env.receiver.push(handoff(r, first, value=first))
    run(env, lambda: a.is_final)
    stop.thread.join(10.0)
    assert stop.aborted == [False]
    assert a.state is State.FINISHED and a.finish_reason == "stop"
    assert a.output_ids == [100, 101, 102]
    run(env, lambda: b.is_final)
    assert b.finish_reason == "length" and b.output_ids == list(range(200, 206))
    assert env.stats.snapshot()["aborted"] == 0
    assert_no_page_held(env)


def test_a_request_sent_back_twice_at_once_goes_back_once(pool):
    """`Engine.reprefill` (an RPC thread: the router says the KV will not come) and the
    decode thread (refusing the same request's handoff) can both send it back to
    prefill: the second finds it gone back already and does nothing, where CI saw an
    illegal WAITING -> WAITING fail the engine and abort every request."""
    env = make(pool)
    r = prefilled(env, "a", 5, 100, 6)
    assert r.state is State.TRANSFERRING
    assert env.requests.resubmit(r)
    assert not env.requests.resubmit(r)               # the other thread, just after
    assert r.state is State.WAITING
    assert env.requests.prefill_inbox.get_nowait() is r
    assert env.requests.prefill_inbox.empty()         # routed once
    r.abort("test over")
    assert not env.requests.resubmit(r)               # nor is an aborted one


def test_a_request_sent_back_to_prefill_while_its_pages_go_in_gives_its_slot_back(pool):
    """`Engine.reprefill` (an RPC thread: the router says the KV will not come) can send a
    request back to prefill after the decode thread saw its transfer finish and while it
    inserts the pages. The request stays with its prefill (no illegal WAITING -> DECODING
    killing the decode thread, as CI once saw), its slot and pages come back, and the
    loop serves the next request."""
    env = make(pool)
    r = prefilled(env, "a", 5, 100, 6)
    insert = env.runner.insert

    def insert_while_reprefilled(*args):
        insert(*args)
        assert env.requests.resubmit(r)               # as Engine.reprefill does, meanwhile
    env.runner.insert = insert_while_reprefilled
    env.receiver.push(handoff(r, 100, value=100))
    run(env, lambda: r.state is State.WAITING and env.scheduler.slot_of(r) is None)
    assert env.requests.prefill_inbox.get_nowait() is r      # routed to prefill again
    env.runner.insert = insert
    nxt = prefilled(env, "b", 9, 200, 4)
    env.receiver.push(handoff(nxt, 200, value=200))
    run(env, lambda: nxt.is_final)
    assert nxt.output_ids == list(range(200, 204))
    r.abort("test over")
    assert_no_page_held(env)


def test_a_step_runs_the_fewest_rows_that_hold_its_busiest_shard(pool):
    """8 slots on each of 2 shards: one stream steps 2 rows a shard (the smallest of
    2, 4, 8), five on one shard step 8; tokens still count from each first token."""
    env = make(pool, slots=8, pages_per_shard=40, num_shards=2)
    first = prefilled(env, "a", 5, first=100, max_tokens=3)
    env.receiver.push(handoff(first, 100))
    run(env, lambda: first.is_final)
    assert {s["rows"] for s in env.runner.steps} == {2 * 2}
    assert first.output_ids == [100, 101, 102]
    many = [prefilled(env, f"r{i}", 3, first=10 * i, max_tokens=4) for i in range(10)]
    for r in many:
        env.receiver.push(handoff(r, r.output_ids[0]))
    run(env, lambda: all(r.is_final for r in many))
    assert max(s["rows"] for s in env.runner.steps) == 2 * 8
    assert all(r.output_ids == [r.output_ids[0] + k for k in range(4)] for r in many)
    assert_no_page_held(env)


def test_an_idle_loop_waiting_for_handoffs_sees_a_request_routed_to_extend(pool):
    """An idle loop waits for a handoff in slices of `EXTEND_POLL_S`, looking at its
    extend loop's inbox between them (the connector does not wake it for that), and
    runs the extend in the same iteration."""
    import queue as queue_mod
    from tests.fake_runner import FakeReceiver

    class _Extend:                        # the parts of `ExtendLoop` the loop uses
        host = None

        def __init__(self):
            self.inbox, self.taken = queue_mod.SimpleQueue(), []

        @property
        def idle(self):
            return self.inbox.empty()

        def run_once(self):
            while not self.inbox.empty():
                self.taken.append(self.inbox.get_nowait())
            return []

    extend = _Extend()

    class _Receiver(FakeReceiver):
        def __init__(self):
            super().__init__()
            self.timeouts = []

        def receive(self, timeout):
            self.timeouts.append(timeout)
            if len(self.timeouts) == 3:
                extend.inbox.put("routed")    # arrives while the loop waits
            return super().receive(timeout)

    env = make(pool, receiver=_Receiver())
    env.loop.extend = extend
    env.loop.iterate(receive_timeout=60.0)
    waits = env.receiver.timeouts
    assert len(waits) == 3 and all(0 < t <= env.loop.EXTEND_POLL_S for t in waits)
    assert extend.taken == ["routed"]
    assert_no_page_held(env)
