"""A worker that switches role while requests stream through the router on both roles
(`SwitchRole`, `Router.switch_role`), on the split controller's decision
(`--role router --elastic`: `ElasticDriver` + `RouterSplit`): every request finishes
with transformers' greedy tokens, nothing leaks on any worker, the worker serves its
new role at a new epoch, and calls meant for its old epoch are refused."""
import threading
import time

import grpc
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.outputs import RequestMetrics
from jaxpd.plan.controller import Split, SplitController
from jaxpd.plan.driver import ElasticDriver
from jaxpd.serving.prometheus import ServingMetrics
from jaxpd.serving.role_switch import other_mesh
from jaxpd.serving.router_split import RouterSplit
from tests.hf_fixtures import hf_greedy

MAX_MODEL_LEN = 160


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_other_role_takes_the_same_devices():
    assert other_mesh("prefill=2", "decode") == "decode=2"
    assert other_mesh("decode=2", "prefill") == "prefill=2"
    assert other_mesh("decode=2x2", "prefill") == "prefill=4"
    for mesh, role in [("prefill=2,decode=2", "decode"), ("colocated=2", "prefill"),
                       ("prefill=2", "router")]:
        with pytest.raises(ValueError, match="single-role mesh"):
            other_mesh(mesh, role)


class _Outbox:
    def __init__(self):
        self.drained = []

    def drain(self, deadline, why):
        self.drained.append(why)


class _Engine:
    def is_idle(self):
        return True

    def shutdown(self, reason):
        self.reason = reason


@pytest.mark.parametrize("peers,moves", [(0, False), (1, True), (None, True)])
def test_a_switching_decode_worker_migrates_only_where_another_can_take_its_requests(
        peers, moves):
    """The router's answer to its draining heartbeat (`decode_peers`): with no other
    decode worker its requests finish in place; with one, or no answer, they move."""
    from jaxpd.serving.role_switch import RoleSwitch

    class Service:
        role, epoch, engine, migration = "decode", 1, _Engine(), _Outbox()
        asked = []

        def decode_peers(self, why):
            self.asked.append(why)
            return peers

    service = Service()
    RoleSwitch(service, lambda role: (_Engine(), "127.0.0.1:1"), drain_s=1).switch("prefill")
    assert service.asked == ["this worker is switching from decode to prefill"]
    assert bool(Service.migration.drained) == moves
    assert (service.role, service.epoch) == ("prefill", 2)


def _start(path, router_address, auth, role, cache=False, migrate=False):
    """An in-process worker of `role` that can switch roles (as `serve_role` builds it);
    `migrate`: as a decode worker, its running requests move out with their KV when it
    drains (`--migrate_on_drain`)."""
    from jaxpd.serving.migration import MigrationOutbox
    from jaxpd.serving.role_server import RoleServer, RoleService, make_connector
    from jaxpd.serving.role_switch import RoleSwitch
    options = dict(max_model_len=MAX_MODEL_LEN, slots_per_shard=4, enable_prefix_caching=cache,
                   migrate_on_drain=migrate)
    connector, kv_address = make_connector(role, "grpc", "127.0.0.1", auth)
    llms = [LLM(path, mesh=f"{role}=1", connector=connector, **options, warmup=False)]
    service = RoleService(llms[0].engine, kv_address, "grpc")

    def outbox(engine, new_role):
        return MigrationOutbox(engine, auth) if migrate and new_role == "decode" else None
    service.migration = outbox(llms[0].engine, role)

    def rebuild(new_role):
        conn, address = make_connector(new_role, "grpc", "127.0.0.1", auth)
        llms.append(LLM(path, mesh=other_mesh(str(llms[-1].config.mesh), new_role),
                        connector=conn, **options, warmup=False))
        service.migration = outbox(llms[-1].engine, new_role)
        return llms[-1].engine, address

    service.switcher = RoleSwitch(service, rebuild, drain_s=30)
    server = RoleServer(service, "127.0.0.1", 0, auth)
    server.start()
    server.register_with(router_address, heartbeat_s=0.2)
    return server, llms


def _driver(router, actuator):
    """The controller on the router's real occupancy, with every scrape adding a
    finished request whose TTFT is 10x the 1 s SLO: prefill overloaded. Decode has room
    (TPOT far under its SLO; occupancy counts from 4x the slots, as the test fills
    them all), so it moves a decode worker to prefill at once (no sustain, no dwell)."""
    metrics = ServingMetrics()

    def render():
        metrics.observe(RequestMetrics(queue_s=None, prefill_s=None, transfer_s=0.0,
                                       transfer_bytes=0, ttft_s=10.0, tpot_s=0.001, itl_s=[],
                                       e2e_s=None, num_preemptions=0))
        return metrics.render(router.stats())
    controller = SplitController(actuator.split(), 1.0, 1.0, occupancy_high=4.0, sustain_s=0,
                                 dwell_s=0)
    return ElasticDriver(controller, render, actuator.prepare, actuator.resplit,
                         actuator.split, 1.0, say=lambda _: None)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [False, True], ids=["cache_off", "cache_on_migrate"])
def test_a_decode_worker_becomes_a_prefill_worker_while_requests_stream(tiny_hf_model, cache):
    """Without migration its decoding requests finish there before it rebuilds. With
    prefix caching on every worker, and `migrate_on_drain`: its decoding requests move
    to the other decode worker with their KV (no prefill again), the switched worker's
    new engine starts with an empty cache and advertises it, the repeated prompts after
    the switch hit the caches, and the page accounting holds with cached pages kept."""
    from jaxpd.auth import InternalAuth
    from jaxpd.serving.role_rpc import RoleClient
    from jaxpd.serving.router import Router, RouterConfig
    path, hf_model = tiny_hf_model
    auth = InternalAuth(token="t" * 32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(5, 60, 10)]
    max_tokens = [int(n) for n in rng.integers(30, 60, 10)]
    expected = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    # A long lease and stall timeout: on a loaded machine the switching worker's compiles
    # can hold up heartbeats and the other workers' streams for seconds (CI once saw a
    # decode stream silent for 5 s, taken for a lost worker), and this test is not about
    # losing workers.
    router = Router(path, RouterConfig(max_model_len=MAX_MODEL_LEN, heartbeat_s=0.5, lease_s=30,
                                       stall_timeout_s=60), auth=auth)
    workers = []
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        for role in ("prefill", "decode", "decode"):
            workers.append(_start(path, address, auth, role, cache, migrate=cache))
        deadline = time.monotonic() + 30
        while len(router.live_workers()) < 3:
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.05)
        requests = [router.submit(router.make_request(prompt_token_ids=p,
                                                      sampling_params=_greedy(n)))
                    for p, n in zip(prompts, max_tokens)]
        # The switch while the first requests decode, on both decode workers.
        deadline = time.monotonic() + 60
        while sum(len(r.output_ids) >= 2 for r in requests) < 4:
            assert time.monotonic() < deadline, "nothing decoded"
            time.sleep(0.01)
        actuator, decisions = RouterSplit(router, 120, say=lambda _: None), []
        driver = _driver(router, actuator)
        switch = threading.Thread(target=lambda: decisions.append(driver.tick()))
        switch.start()
        outs = [router._wait(r) for r in requests]
        switch.join(timeout=180)
        assert decisions[0].old == Split(1, 2) and decisions[0].new == Split(2, 1)
        (switching, role, answer), = actuator.switched
        assert role == "prefill" and answer == {"role": "prefill", "epoch": 2}
        index = [server.address for server, _ in workers].index(switching)
        assert index in (1, 2)
        for out, exp in zip(outs, expected):
            assert out.finish_reason == "length" and out.token_ids == exp
        deadline = time.monotonic() + 10
        while router.live_workers().get(switching) != "prefill":
            assert time.monotonic() < deadline, router.live_workers()
            time.sleep(0.05)
        # The new role serves: more requests, now with two prefill workers.
        more = router.generate(prompt_token_ids=prompts[:4],
                               sampling_params=[_greedy(n) for n in max_tokens[:4]])
        assert [o.token_ids for o in more] == expected[:4]
        hits = sum(llms[-1].stats().get("prefill_cache_hit_tokens", 0) +
                   llms[-1].stats().get("prefix_hit_tokens", 0) for _, llms in workers)
        assert (hits > 0) == cache               # the repeats hit only with the cache on
        switched = workers[index][1][-1]
        assert switched.stats()["prefill_batches"] > 0 or \
            workers[0][1][-1].stats()["prefill_batches"] > 0
        # Calls for the old epoch (its decode role) are refused, naming both epochs.
        client = RoleClient(switching, auth)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                client.abort("rt-0", "late", timeout=5, epoch=1)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "stale epoch" in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                list(client.decode(requests[0].to_wire(), epoch=1))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert client.abort("rt-0", "late", timeout=5, epoch=2) is False
        finally:
            client.close()
        # Nothing leaked: every decode slot and page is back, on every engine.
        for _, llms in workers:
            for llm in llms:
                stats = llm.stats()
                assert stats["slots_active"] == 0 and stats["pages_used"] == 0, stats
        counts = router.counters.snapshot()
        assert counts["finished"] == len(prompts) + 4 and counts["aborted"] == 0
        assert counts["decode_failovers"] == 0
        drained = workers[index][1][0].stats()
        if cache:
            # Its decoding requests moved on with their KV; no move failed, so none was
            # prefilled again (the router prefills again only on a fallback or failover).
            assert counts["migrations"] == drained["migrations_out"] >= 1
            assert counts["migration_fallbacks"] == 0
        else:
            # It drained: the requests it was decoding finished there.
            assert drained["finished"] > 0 and drained["migrations_out"] == 0
        assert counts["resplits"] == 1
        totals = router.stats()
        assert (totals["prefill_devices"], totals["decode_devices"]) == (2, 1)
    finally:
        router.shutdown()
        for server, llms in workers:
            server.stop(0)
            for llm in llms:
                llm.shutdown()
