"""Soak: the router deployment under steady random traffic -- cancels, short deadlines,
complete requests -- while one decode worker is SIGKILLed (and a new one started) and
another is SIGSTOPped and resumed. Bounded (30 s of traffic).

What must hold at the end: no call outlived its deadline (+ a margin); every request
the router accepted finished or was aborted with a reason (its counters add up
exactly); every finished request has the single-process greedy tokens; no worker still
holds a KV page or a slot.
"""
import dataclasses
import random
import signal
import threading
import time

import grpc
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.role_rpc import RoleClient
from jaxpd.auth import InternalAuth
from tests.support.deployments import deployment, router_model

pytestmark = pytest.mark.slow

TOKEN = "soak-cluster-token-0123456789abcdef"
TRAFFIC_S = 30.0
CLIENTS = 6
MARGIN_S = 5.0                     # a call may end this much after its deadline
LIVENESS = ["--heartbeat_s", "0.3", "--lease_s", "1.5", "--stall_timeout_s", "2"]


@pytest.fixture(scope="module")
def model(tiny_hf_model):
    return router_model(tiny_hf_model)


@dataclasses.dataclass
class Call:
    kind: str                      # "complete" | "cancel" | "deadline"
    prompt: int
    max_tokens: int
    deadline_s: float
    elapsed_s: float = 0.0
    outcome: str = ""              # "length" | "abort" | a grpc status name
    tokens: tuple[int, ...] = ()
    abort_reason: str = ""


def _one_call(stub, rng: random.Random, prompts, long_tokens) -> Call:
    i = rng.randrange(len(prompts))
    kind = rng.choices(["complete", "cancel", "deadline"], weights=[2, 1, 1])[0]
    deadline = {"complete": 40.0, "cancel": 40.0, "deadline": rng.uniform(0.1, 1.5)}[kind]
    call = Call(kind, i, rng.randint(1, long_tokens[i]), deadline)
    req = jaxpd_pb2.GenerateRequest(token_ids=jaxpd_pb2.TokenIds(ids=prompts[i]),
                                    max_tokens=call.max_tokens, temperature=0.0,
                                    ignore_eos=True)
    start = time.monotonic()
    try:
        if kind == "cancel":
            stream = stub.Generate(req, timeout=deadline)
            keep = rng.randint(1, 3)
            tokens = []
            for msg in stream:
                tokens += msg.token_ids
                if msg.HasField("finish_reason"):
                    call.outcome = msg.finish_reason
                    call.abort_reason = msg.metrics.abort_reason
                    call.tokens = tuple(tokens)
                    break
                if len(tokens) >= keep:
                    stream.cancel()
                    call.outcome = "CANCELLED"
                    break
        else:
            out = stub.Complete(req, timeout=deadline)
            call.outcome, call.tokens = out.finish_reason, tuple(out.token_ids)
            call.abort_reason = out.metrics.abort_reason
    except grpc.RpcError as e:
        call.outcome = e.code().name
    call.elapsed_s = time.monotonic() - start
    return call


def _wait_busy(client: RoleClient, auth_timeout: float = 60.0) -> None:
    """Until the worker holds at least one request (so the fault hits live streams)."""
    deadline = time.monotonic() + auth_timeout
    while time.monotonic() < deadline:
        info = client.info(timeout=10)
        if info["free_slots"] < info["slots_total"]:
            return
        time.sleep(0.02)
    raise AssertionError("the worker never got a request")


def test_soak_router_deployment_with_cancels_deadlines_kill_and_sigstop(model, procs):
    path, prompts, _, _, long_tokens, expected_long = model
    env = {"JAXPD_CLUSTER_TOKEN": TOKEN}
    addr, router, workers = deployment(procs, path, num_decode=2, transport="grpc",
                                        extra=LIVENESS, router_extra=LIVENESS, env=env)
    auth = InternalAuth(token=TOKEN)
    address_of = lambda w: procs.wait_line(w, r"worker on (\S+)").group(1)
    clients = {w: RoleClient(address_of(w), auth=auth) for w in workers}
    decode_args = list(workers[1].args[3:])     # to start a replacement the same way

    calls: list[Call] = []
    stop_at = time.monotonic() + TRAFFIC_S

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(addr) as channel:
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            while time.monotonic() < stop_at:
                calls.append(_one_call(stub, rng, prompts, long_tokens))

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        # A decode worker freezes for 4 s mid-stream, then resumes.
        frozen, killed = workers[2], workers[1]
        time.sleep(4)
        _wait_busy(clients[frozen])
        frozen.send_signal(signal.SIGSTOP)
        time.sleep(4)
        frozen.send_signal(signal.SIGCONT)
        # The other dies mid-stream; a new one is started in its place.
        _wait_busy(clients[killed])
        killed.send_signal(signal.SIGKILL)
        replacement = procs.start(decode_args, env=env)
        clients[replacement] = RoleClient(address_of(replacement), auth=auth)
        procs.wait_line(router, rf"worker {address_of(replacement)} joined")
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
        for t in threads:
            t.join(TRAFFIC_S + 120)
    assert not any(t.is_alive() for t in threads), "a client call hung"

    # No call outlived its deadline.
    late = [c for c in calls if c.elapsed_s > c.deadline_s + MARGIN_S]
    assert late == [], late[:5]
    # Every finished call has the single-process greedy tokens; aborts carry a reason.
    for c in calls:
        if c.outcome == "length":
            assert list(c.tokens) == expected_long[c.prompt][:c.max_tokens], c
        elif c.outcome == "abort":
            assert c.abort_reason, c
    outcomes = {c.outcome for c in calls}
    assert {"length", "CANCELLED", "DEADLINE_EXCEEDED"} <= outcomes, outcomes

    # The router's books balance once everything has ended; no worker holds a page.
    with grpc.insecure_channel(addr) as channel:
        stub = jaxpd_pb2_grpc.GenerationStub(channel)
        deadline = time.monotonic() + 30
        while True:
            stats = stub.Stats(jaxpd_pb2.StatsRequest(), timeout=10)
            if stats.requests_in_flight == 0 and stats.requests_submitted == (
                    stats.finished + stats.aborted):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
    assert stats.requests_submitted >= len([c for c in calls if c.outcome == "length"])
    assert stats.decode_failovers >= 1, stats
    live = [w for w in clients if w.poll() is None]
    assert killed not in live and frozen in live and replacement in live
    deadline = time.monotonic() + 30
    for w in live:
        while True:
            info = clients[w].info(timeout=10)
            if (info["free_pages"], info["free_slots"]) == (info["pages_total"],
                                                          info["slots_total"]):
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.2)
