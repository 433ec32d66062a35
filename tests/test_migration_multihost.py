"""Live migration out of and into a decode role whose mesh spans two processes
(`decode=2`, one virtual device each, or `decode=1x2`, tp over them; jax.distributed
over gloo), behind the router, beside a one-process decode worker and a prefill worker
(`python -m jaxpd.launch`, the transfer server).

SIGTERM to the role's leader while it decodes moves its requests to the other decode
worker with their KV: the leader cuts each one's pages with a plan op its follower
replays (`engine.multihost.decode`, `cut`), and the handoff leaves from the leader as
in one process. SIGTERM to the one-process worker moves its requests into the role (a
handoff lands there as a prefill worker's does). Every stream finishes with the tokens
of an unmoved run (greedy: transformers'; seeded sampling: the same requests run
before, unmoved), the prefill worker computes no prompt again, the drained worker
leaves holding no slot or page, a drained role's follower stops when told, and the
target gives every page back.
"""
import re
import signal
import threading
import time

import grpc
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.role_rpc import RoleClient
from jaxpd.transfer import jax_compat
from tests.engine_fixtures import reference
from tests.support.deployments import (COMMON, PATIENT_ROUTER, coordinator, free_port,
                                       stream_tokens)

pytestmark = pytest.mark.slow
# Long enough that the role still decodes when it is drained.
MAX_MODEL_LEN = 320


def _request(prompt, max_tokens, seed):
    """Greedy when `seed` is None, else seeded sampling."""
    sampling = dict(temperature=0.0) if seed is None else \
        dict(temperature=0.9, top_k=40, seed=seed)
    return jaxpd_pb2.GenerateRequest(token_ids=jaxpd_pb2.TokenIds(ids=prompt),
                                     max_tokens=max_tokens, ignore_eos=True, **sampling)


def _deployment(procs, path, mesh):
    if jax_compat.unavailable_reason() is not None:
        pytest.skip(jax_compat.unavailable_reason())
    router_port = free_port()
    # By load alone: a repeated prompt would otherwise go to the worker holding it.
    router = procs.start(["--role", "router", "--model", path, "--port", str(router_port),
                          "--internal_port", "0"] + COMMON + PATIENT_ROUTER +
                         ["--noenable_prefix_caching", "--max_model_len", str(MAX_MODEL_LEN)])
    internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
    common = COMMON + ["--kv_transport", "transfer_server", "--router", internal,
                       "--slots_per_shard", "4", "--max_model_len", str(MAX_MODEL_LEN),
                       "--noenable_prefix_caching"]
    prefill = procs.start(["--role", "prefill", "--mesh", "prefill=1", "--model", path,
                           "--port", "0"] + common)
    group = ["--role", "decode", "--mesh", mesh, "--model", path, "--port", "0",
             "--num_processes", "2", "--coordinator", coordinator(),
             "--shutdown_timeout_s", "60"] + common
    leader = procs.start(group + ["--process_id", "0"])
    follower = procs.start(group + ["--process_id", "1"])
    other = procs.start(["--role", "decode", "--mesh", "decode=1", "--model", path,
                         "--port", "0"] + common)
    clients = []
    for w in (prefill, leader, other):
        address = procs.wait_line(w, r"worker on (\S+)").group(1)
        procs.wait_line(router, rf"worker {re.escape(address)} joined")
        clients.append(RoleClient(address))
    procs.wait_line(router, r"jaxpd serving")
    return f"127.0.0.1:{router_port}", router, leader, follower, other, clients


def _drained_line(procs, p):
    return procs.wait_line(p, r"decode worker drained: (\d+) requests moved out, (\d+) moves "
                           r"failed, (\d+) dropped unasked; (\d+) slots and (\d+) pages "
                           r"still in use")


# out: SIGTERM to the role's leader, its requests move to the one-process worker;
# into: SIGTERM to the one-process worker, its requests move into the role. decode=1x2:
# one dp shard across both processes (tp over them), each holding half its kv heads.
# The default run covers one direction; the others run with -m matrix (CI time).
@pytest.mark.parametrize("direction,mesh", [
    ("out", "decode=2"),
    pytest.param("into", "decode=2", marks=pytest.mark.matrix),
    pytest.param("out", "decode=1x2", marks=pytest.mark.matrix)])
def test_migration_out_of_and_into_a_decode_role_across_processes_is_token_identical(
        tiny_hf_model, procs, direction, mesh):
    path, hf = tiny_hf_model
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(12 + 9 * i)] for i in range(6)]
    max_tokens = [MAX_MODEL_LEN - 10 - len(p) for p in prompts]
    seeds = [None if i % 2 == 0 else 100 + i for i in range(len(prompts))]
    addr, router, leader, follower, other_proc, clients = _deployment(procs, path, mesh)
    prefill, role, other = clients
    victim, source, target = (leader, role, other) if direction == "out" else \
        (other_proc, other, role)
    channel = grpc.insecure_channel(addr)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    try:
        # The unmoved run: greedy equals transformers'; seeded is its own reference.
        greedy = [i for i, s in enumerate(seeds) if s is None]
        expected = dict(zip(greedy, reference(hf, [prompts[i] for i in greedy],
                                              [max_tokens[i] for i in greedy])))
        for i, s in enumerate(seeds):
            if s is not None:
                out = stub.Complete(_request(prompts[i], max_tokens[i], s), timeout=300)
                expected[i] = list(out.token_ids)
        source_idle, target_idle = source.info(timeout=10), target.info(timeout=10)
        before = prefill.info(timeout=10)["counters"]["prefill_tokens"]

        outs = [[] for _ in prompts]
        streams = [threading.Thread(target=stream_tokens, args=(stub, _request(p, n, s), o))
                   for p, n, s, o in zip(prompts, max_tokens, seeds, outs)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 240
        while source.info(timeout=10)["free_slots"] == source_idle["free_slots"]:
            assert time.monotonic() < deadline, procs.tails()   # it decodes some
            assert any(t.is_alive() for t in streams), procs.tails()
            time.sleep(0.01)
        victim.send_signal(signal.SIGTERM)
        for t in streams:
            t.join(300)
        for i, out in enumerate(outs):
            assert out == expected[i] + ["length"], (i, procs.tails())
        assert victim.wait(timeout=120) == 0, "".join(victim.lines)
        drained = _drained_line(procs, victim)
        moved = int(drained.group(1))
        assert moved >= 1 and drained.groups()[1:] == ("0", "0", "0", "0")
        if direction == "out":
            assert follower.wait(timeout=60) == 0, "".join(follower.lines)
            assert any("decode follower 1 stopped" in line for line in follower.lines)
            assert re.search(r"decode leader plan: .*\bcut: \d+ messages",
                             "".join(leader.lines))
        # Each prompt computed once (no prefix cache): the moved requests' KV came along.
        assert prefill.info(timeout=10)["counters"]["prefill_tokens"] - before == \
            sum(map(len, prompts))
        stats = stub.Stats(jaxpd_pb2.StatsRequest(), timeout=30)
        assert (stats.migrations, stats.migration_fallbacks, stats.migration_failures) == \
            (moved, 0, 0)
        assert stats.decode_failovers == 0 and stats.aborted == 0
        info = target.info(timeout=10)
        assert info["transfers"] - target_idle["transfers"] >= moved
        deadline = time.monotonic() + 30
        while (info["free_slots"], info["free_pages"]) != (target_idle["free_slots"],
                                                           target_idle["free_pages"]):
            assert time.monotonic() < deadline, info       # the target leaks nothing
            time.sleep(0.05)
            info = target.info(timeout=10)
        if direction == "into":       # the role stops cleanly, its follower told
            leader.send_signal(signal.SIGTERM)
            assert leader.wait(timeout=60) == 0, "".join(leader.lines)
            assert follower.wait(timeout=60) == 0, "".join(follower.lines)
    finally:
        channel.close()
        for c in clients:
            c.close()
