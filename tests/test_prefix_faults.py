"""Prefix caching under faults: a prefill worker killed in the middle of a
conversation served with prefix routing. Every turn still equals transformers' greedy
continuation, and afterwards the surviving workers' page accounting is exact and their
counters (and the router's) say what happened."""
import threading
import time

import numpy as np
import pytest

from jaxpd.transfer.connector import TransferError
from tests.engine_fixtures import wait_idle
from tests.support.prefix_chats import (chat, check_pool, conversation, page_bytes,
                                        start_workers)

PAGE = 16


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _check_prefill_worker(llm) -> None:
    """A prefill-only engine holds nothing between batches: idle, nothing queued, and
    (with its own prefix cache) no page referenced, the pool's books balanced."""
    wait_idle(llm)
    stats = llm.stats()
    assert stats["queue_waiting"] == 0 and stats["pages_used"] == 0, stats
    cache = getattr(llm.engine, "prefill_cache", None)
    if cache is not None:
        cache.allocator.check()
        assert cache.allocator.num_used == 0
        assert cache.allocator.num_free == cache.allocator.capacity


def synced_skip(router, llm, server, conv) -> int:
    """The pages of `conv` the decode worker's cache holds, once the router's index
    (advertised and relayed) says the same: what the next turn's handoff leaves out.
    Whether a finished turn's last token's page was written depends on whether its
    slot ran one more step, so the test reads it rather than assuming it."""
    sched = llm.engine.decode_scheduler
    query = router.prefix.query(conv)

    def held() -> int:
        return max(len(a.cached_prefix(sched.hashes(conv))) for a in sched.allocators)
    _until(lambda: router.prefix.cached_tokens(server.address, query) == held() * PAGE, 10,
           "the router's index does not match the decode worker's cache")
    return held()


@pytest.mark.slow
def test_prefill_worker_killed_mid_conversation_fails_over_and_accounting_is_exact(
        tiny_hf_model):
    """Two prefill workers and one decode worker, all with prefix caching, behind a
    router with prefix routing and `prefix_extend_below=0` (every turn goes through a
    prefill worker). Two, so that the failover under test is the router's move to the
    other prefill worker with the prefix hint intact (the decode worker's own
    re-prefill, `decode_prefills`, is the path of a deployment left with no prefill
    worker, covered without the cache by test_router_prefill_faults.py).
    Turn 1 completes. Turn 2 reaches the prefill worker that served turn 1, which
    computes it and is killed (server stopped with grace 0, engine shut down) while its
    handoff -- leaving out the pages the decode worker holds -- is about to be sent:
    nothing reaches the decode side. The router fails over to the other prefill worker,
    whose handoff carries the same skip; the dead worker's lease runs out and it is
    dropped; turn 3 goes to the survivor. Every turn equals transformers'. Afterwards:
    the decode worker's pool is exact (no page held, no slot used, the cache's books
    balanced) and it received exactly three handoffs that, with the cached pages they
    left out, cover every prompt page (no transfer failed, none refused, no stale
    skip); the surviving prefill worker holds nothing; the router counts one prefill
    failover, one dropped worker, three finished requests, no other failover or abort.
    The lease is six heartbeats: on a loaded host a late heartbeat must not drop a live
    worker (the decode worker, the only one, would take the turn with it)."""
    from jaxpd.auth import InternalAuth
    from jaxpd.serving.router import Router, RouterConfig
    path, hf_model = tiny_hf_model
    auth = InternalAuth(token="t" * 32)
    workers, killed = [], set()
    router = Router(path, RouterConfig(max_model_len=192, heartbeat_s=1.0, lease_s=6.0,
                                       prefix_routing=True, prefix_extend_below=0),
                    auth=auth)
    release = threading.Event()
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        start_workers(workers, path, address, auth, ["prefill", "prefill", "decode"])
        _until(lambda: len(router.live_workers()) == 3, 30, "workers did not register")
        prefillers, (decode_llm, decode_server, _) = workers[:2], workers[2]
        page = page_bytes(decode_llm)
        system, users = conversation(np.random.default_rng(7), turns=3)

        # ---- turn 1: normal -------------------------------------------------------
        conv = chat(router, hf_model, system, users[:1])
        served = [w for w in prefillers if w[0].stats()["prefill_batches"] > 0]
        assert len(served) == 1
        victim = served[0]
        survivor = next(w for w in prefillers if w is not victim)
        victim_llm, victim_server, victim_connector = victim

        # ---- turn 2: its prefill worker dies holding the computed KV ---------------
        # The victim's KV sender blocks on its next handoff (turn 2's: the router picks
        # the same prefill worker again) until the test releases it, then fails as a
        # dead process's would: nothing reaches the decode side.
        # Both prefill workers idle in the router's view (a heartbeat since turn 1): at
        # equal load, turn 1's worker wins by the prompt prefix its cache holds.
        _until(lambda: all(w.load["queue"] == 0 for w in router.workers.live("prefill")),
               10, "prefill workers' load not refreshed")
        skip2 = synced_skip(router, decode_llm, decode_server, conv)
        blocked, held = threading.Event(), []

        def dying_send(handoff):
            held.append(handoff)
            blocked.set()
            release.wait(120)
            raise TransferError("prefill worker killed")

        victim_connector.send = dying_send
        prompt2 = conv + users[1]
        out2 = {}

        def turn2():
            try:
                out2["conv"] = chat(router, hf_model, conv, users[1:2])
            except BaseException as e:   # noqa: B902 -- re-raised in the test thread
                out2["error"] = e

        turn2_thread = threading.Thread(target=turn2, name="turn2")
        turn2_thread.start()
        assert blocked.wait(60), "turn 2 did not reach the prefill worker of turn 1"
        assert held[0].num_tokens == len(prompt2)
        # The decode worker holds turn 1's full pages (prompt and answer, its last
        # token's page too when the finished slot wrote it) and advertised them: the
        # handoff leaves them out.
        assert held[0].first_page == skip2 >= 2

        def kill():
            victim_server.stop(0)          # its open Prefill call is cancelled
            killed.add(id(victim))
            victim_llm.shutdown()

        killer = threading.Thread(target=kill, name="kill-prefill")
        killer.start()
        # Deterministic: the router has seen the Prefill call fail (and moved to the
        # other prefill worker) before the dead worker's sender is let go.
        _until(lambda: router.counters.snapshot()["prefill_failovers"] == 1, 30,
               "the router did not fail over from the killed prefill worker")
        release.set()
        killer.join(60)
        assert not killer.is_alive()
        turn2_thread.join(120)
        assert not turn2_thread.is_alive()
        if "error" in out2:
            raise out2["error"]
        conv = out2["conv"]
        assert len(held) == 1                   # the victim never sent anything else

        # ---- the dead worker's lease runs out; turn 3 goes to the survivor ----------
        _until(lambda: victim_server.address not in router.live_workers(), 15,
               "the killed prefill worker was not dropped")
        skip3 = synced_skip(router, decode_llm, decode_server, conv)
        prompts = [len(system) + len(users[0]), len(prompt2), len(conv) + len(users[2])]
        conv = chat(router, hf_model, conv, users[2:])

        # ---- afterwards ----------------------------------------------------------
        assert router.live_workers() == {survivor[1].address: "prefill",
                                         decode_server.address: "decode"}
        counts = router.counters.snapshot()
        assert counts["requests_submitted"] == 3 and counts["finished"] == 3, counts
        assert counts["aborted"] == 0 and counts["decode_failovers"] == 0, counts
        assert counts["prefill_failovers"] == 1 and counts["workers_dropped"] == 1, counts
        assert counts["decode_prefills"] == 0 and counts["prefix_routed"] == 0, counts

        check_pool(decode_llm)
        d = decode_llm.stats()
        assert d["transfers"] == 3 and d["local_prefills"] == 0, d
        assert d["transfer_failures"] == 0 and d["handoffs_rejected"] == 0, d
        assert d["prefix_skip_misses"] == 0 and d["aborted"] == 0, d
        # Turns 2 and 3 left out the pages the decode worker held; together with what
        # moved, every page of every prompt is accounted for exactly once.
        assert d["prefix_saved_bytes"] == (skip2 + skip3) * page, (d, skip2, skip3)
        assert d["transfer_bytes"] + d["prefix_saved_bytes"] == sum(
            -(-n // PAGE) for n in prompts) * page, (d, prompts)
        assert d["pages_cached"] > 0
        load = decode_server.service.load()
        assert load["free_slots"] == d["slots_total"] and load["free_pages"] == d["pages_total"]

        survivor_llm = survivor[0]
        _check_prefill_worker(survivor_llm)
        s = survivor_llm.stats()
        assert s["prefill_batches"] == 2 and s["transfer_failures"] == 0, s
        assert s["aborted"] == 0, s
        # The victim served turn 1 and computed turn 2, whose send then failed.
        v = victim_llm.stats()
        assert v["prefill_batches"] == 2 and v["transfer_failures"] == 1, v
    finally:
        release.set()
        router.shutdown()
        for w in workers:
            if id(w) not in killed:
                w[1].stop(0)
                w[0].shutdown()
