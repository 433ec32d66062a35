"""Router + prefill + decode as separate processes on 127.0.0.1, killed at chosen moments.

Every request must end finished (with the single-process greedy tokens) or aborted with
a reason; no process may hang past its timeout.
"""
import os
import re
import signal
import threading
import time

import grpc
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.role_rpc import RoleClient
from tests.support.deployments import LAYERWISE, NUM, deployment, generate_all, router_model
from tests.support.internal_plane import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tiny_hf_model):
    return router_model(tiny_hf_model)


@pytest.mark.parametrize("transport", ["transfer_server", "grpc"])
def test_router_prefill_decode_processes_match_single_process(model, procs, transport):
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, router, _ = deployment(procs, path, transport=transport)
    outs = generate_all(addr, prompts, max_tokens)
    assert [list(o.token_ids) for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    router.send_signal(signal.SIGTERM)
    assert router.wait(timeout=60) == 0


@pytest.mark.parametrize("transport", ["transfer_server", "grpc"])
def test_router_layerwise_transfer_matches_single_process(model, procs, transport):
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, router, workers = deployment(procs, path, transport=transport, extra=LAYERWISE)
    decode = RoleClient(procs.wait_line(workers[1], r"decode worker on (\S+)").group(1))
    before = decode.info(timeout=10)
    outs = generate_all(addr, prompts, max_tokens)
    assert [list(o.token_ids) for o in outs] == expected
    held = lambda info: (info["free_slots"], info["free_pages"])
    # The decode thread frees a finished request's slot right after it hands over the
    # last token, so the client may ask before that: wait for the books to balance.
    wait_until(lambda: held(decode.info(timeout=10)) == held(before))
    after = decode.info(timeout=10)
    # Prompts of 17+ tokens fill buckets of 32+: layer-wise; the rest went whole.
    assert after["transfers"] == NUM
    assert after["layerwise_transfers"] == sum(len(p) > 16 for p in prompts) == 4


def test_decode_worker_killed_fails_over_to_another(model, procs):
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, _, workers = deployment(procs, path, num_decode=2)
    holder = {}

    def run():
        holder["outs"] = generate_all(addr, prompts, long_tokens)

    t = threading.Thread(target=run)
    t.start()
    # Kill whichever decode worker first holds two requests mid-stream.
    clients = [RoleClient(procs.wait_line(w, r"decode worker on (\S+)").group(1))
               for w in workers[1:]]
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline:
        for w, c in zip(workers[1:], clients):
            info = c.info(timeout=10)
            if info["free_slots"] <= 8 - 2:
                victim = w
                break
        time.sleep(0.02)
    assert victim is not None
    victim.kill()
    t.join(180)
    outs = holder["outs"]
    assert all(o.finish_reason == "length" for o in outs)   # the other worker took over
    assert [list(o.token_ids) for o in outs] == expected_long
    # Failover recomputes from prompt + tokens so far: greedy output is unchanged.
    with grpc.insecure_channel(addr) as channel:
        stats = jaxpd_pb2_grpc.GenerationStub(channel).Stats(jaxpd_pb2.StatsRequest(), timeout=30)
    assert stats.decode_failovers > 0


def test_last_decode_worker_killed_aborts_with_a_reason(model, procs):
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, _, workers = deployment(procs, path)
    holder = {}
    t = threading.Thread(target=lambda: holder.update(outs=generate_all(addr, prompts, long_tokens)))
    t.start()
    client = RoleClient(procs.wait_line(workers[1], r"decode worker on (\S+)").group(1))
    deadline = time.monotonic() + 120
    while client.info(timeout=10)["free_slots"] > 8 - 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    workers[1].kill()
    t.join(180)
    assert not t.is_alive()                   # nobody waits forever
    outs = holder["outs"]
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert aborted and all("no decode worker" in o.metrics.abort_reason for o in aborted)
    for o, e in zip(outs, expected_long):
        if o.finish_reason == "length":
            assert list(o.token_ids) == e


TOKEN = "deployment-cluster-token-0123456789"


def test_cluster_token_deployment_matches_single_process(model, procs):
    """Every internal call (register, heartbeat, prefill, decode, KV control and stream)
    on a token-authenticated plane; strangers are refused by every worker."""
    from jaxpd.auth import InternalAuth
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    addr, router, workers = deployment(procs, path, transport="grpc",
                                        env={"JAXPD_CLUSTER_TOKEN": TOKEN})
    assert "(auth: cluster token)" in "".join(router.lines)
    outs = generate_all(addr, prompts, max_tokens)
    assert [list(o.token_ids) for o in outs] == expected
    decode = procs.wait_line(workers[1], r"decode worker on (\S+)").group(1)
    assert RoleClient(decode, InternalAuth(token=TOKEN)).info(timeout=10)["transfers"] == NUM
    with pytest.raises(grpc.RpcError) as e:
        RoleClient(decode).abort("rt-0", "stranger", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Every role answers GET /health on its HTTP port (workers: /health and /metrics only).
    import json
    import urllib.request
    for w, role in zip(workers, ("prefill", "decode")):
        url = procs.wait_line(w, r"worker HTTP \(/health, /metrics\) on (\S+)").group(1)
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
        assert health["status"] == "ok" and health["role"] == role, health
        assert health["pages_used"] == 0
    assert health["slots_total"] > 0 and health["pages_total"] > 0      # the decode worker


def test_sigstop_decode_worker_calls_end_then_it_rejoins(model, procs):
    """A decode worker frozen mid-stream (SIGSTOP): every call ends within a few
    seconds (its lease runs out, or its stream stalls, and the other worker takes over);
    after SIGCONT it heartbeats again, rejoins and serves."""
    path, prompts, max_tokens, expected, long_tokens, expected_long = model
    liveness = ["--heartbeat_s", "0.3", "--stall_timeout_s", "2"]
    # Routing by load alone: with prefix routing the survivor holds every prompt of the
    # stream it took over, and the rejoined worker's "serves again" check would see the
    # repeats all sent to the holder (CI once: no transfer to the rejoined worker).
    addr, router, workers = deployment(procs, path, num_decode=2, transport="grpc",
                                        extra=liveness,
                                        router_extra=liveness + ["--noenable_prefix_caching"])
    clients = [RoleClient(procs.wait_line(w, r"decode worker on (\S+)").group(1))
               for w in workers[1:]]
    holder = {}
    t = threading.Thread(target=lambda: holder.update(
        outs=generate_all(addr, prompts, long_tokens, timeout=120)))
    t.start()
    deadline = time.monotonic() + 120
    victim = None
    while victim is None:
        assert time.monotonic() < deadline
        for i, c in enumerate(clients):
            if c.info(timeout=10)["free_slots"] <= 8 - 2:
                victim = i
                break
        time.sleep(0.02)
    workers[1 + victim].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        t.join(60)
        assert not t.is_alive(), "a call hung on the frozen worker"
        survivor = clients[1 - victim]
        procs.wait_line(router, rf"decode worker {re.escape(clients[victim].address)} left")
        assert time.monotonic() - stopped < 60      # bounded (never the 120 s deadline)
        outs = holder["outs"]
        assert [list(o.token_ids) for o in outs] == expected_long   # failed over, same tokens
        joined = "".join(router.lines).count(f"decode worker {clients[victim].address} joined")
    finally:
        workers[1 + victim].send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while "".join(router.lines).count(f"decode worker {clients[victim].address} joined") == joined:
        assert time.monotonic() < deadline, "".join(router.lines)
        time.sleep(0.05)
    before = clients[victim].info(timeout=10)["transfers"]
    outs = generate_all(addr, prompts, max_tokens)
    assert [list(o.token_ids) for o in outs] == expected
    assert clients[victim].info(timeout=10)["transfers"] > before    # it serves again
    assert survivor.info(timeout=10)["free_slots"] == 8
