"""A prefill role whose mesh spans two processes (jax.distributed; gloo on CPU), behind
the router: 2 processes x 2 virtual devices = one tp=4 mesh, led by process 0.

Greedy tokens must equal transformers' (and so the single-process meshes', which the
engine tests hold to the same), the KV moved must be exactly the requests' pages, and
a killed follower must stop the role at once, with the router failing its requests
over and no page leaking on the decode side.
"""
import re
import signal
import time

import pytest

from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.serving.role_rpc import RoleClient
from tests.engine_fixtures import mixed_prompts, reference
from tests.support.checkpoints import negated_copy
from tests.support.deployments import (COMMON, PATIENT_ROUTER, coordinator, free_port,
                                       generate_all, page_bytes)

pytestmark = pytest.mark.slow
NUM = 16


@pytest.fixture(scope="module")
def model(hf_models):
    # Four kv heads over tp=4: each process holds two of them and offers them itself.
    path, hf = hf_models("llama_tied")
    prompts = mixed_prompts(NUM, 256, seed=11)
    max_tokens = [3 + i % 6 for i in range(NUM)]
    return path, prompts, max_tokens, reference(hf, prompts, max_tokens)


def _deployment(procs, path, transport):
    router_port = free_port()
    router = procs.start(["--role", "router", "--model", path, "--port", str(router_port),
                          "--internal_port", "0"] + COMMON + PATIENT_ROUTER)
    internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
    common = COMMON + ["--kv_transport", transport, "--router", internal]
    # Prompts of 128+ tokens go layer-wise, in two parts (each offered as pieces too).
    group = ["--role", "prefill", "--mesh", "prefill=4", "--model", path, "--port", "0",
             "--num_processes", "2", "--coordinator", coordinator(), "--layerwise_parts", "2",
             "--layerwise_min_tokens", "128"] + common
    leader = procs.start(group + ["--process_id", "0"])
    follower = procs.start(group + ["--process_id", "1"])
    decode = procs.start(["--role", "decode", "--mesh", "decode=2", "--model", path,
                          "--port", "0", "--slots_per_shard", "4"] + common)
    # Each process read only the weight shards its two devices hold (and the
    # replicated ones).
    read = procs.wait_line(follower, r"prefill follower 1/2 of the mesh prefill=4.* it read "
                                     r"(\d+)% of the weights")
    assert 40 <= int(read.group(1)) < 100
    for w in (leader, decode):
        address = procs.wait_line(w, r"worker on (\S+)").group(1)
        procs.wait_line(router, rf"worker {re.escape(address)} joined")
    procs.wait_line(router, r"jaxpd serving")
    return f"127.0.0.1:{router_port}", router, leader, follower, decode


# The transfer server: each process offers its own kv heads; the gRPC stream: the
# leader gathers them and sends the whole KV.
@pytest.mark.parametrize("transport", ["transfer_server", "grpc"])
def test_prefill_mesh_of_two_processes_matches_transformers_then_survives_a_lost_follower(
        model, procs, transport):
    path, prompts, max_tokens, expected = model
    addr, router, leader, follower, decode_proc = _deployment(procs, path, transport)
    decode = RoleClient(procs.wait_line(decode_proc, r"decode worker on (\S+)").group(1))
    before = decode.info(timeout=10)
    outs = generate_all(addr, prompts, max_tokens)
    assert [list(o.token_ids) for o in outs] == expected
    after = decode.info(timeout=10)
    assert after["transfers"] - before["transfers"] == NUM
    moved = after["transfer_bytes"] - before["transfer_bytes"]
    assert moved == sum(pages_for(len(p), 16) for p in prompts) * page_bytes(path)
    # Each handoff (a layer-wise one: each of its two parts) came as two pieces, each
    # process's own kv heads from that process.
    layerwise = after["layerwise_transfers"] - before["layerwise_transfers"]
    assert 0 < layerwise < NUM
    pieces = after["counters"]["kv_pieces_pulled"] - before["counters"]["kv_pieces_pulled"]
    assert pieces == (2 * (NUM + layerwise) if transport == "transfer_server" else 0)

    # A follower dies: the leader stops the role within seconds, saying why; the
    # router fails the requests over (here: prefilled on the decode worker).
    follower.send_signal(signal.SIGKILL)
    start = time.monotonic()
    assert leader.wait(timeout=60) == 1
    assert time.monotonic() - start < 30
    assert any(re.search(r"prefill role stopped: follower process 1 has not answered", line)
               for line in leader.lines), "".join(leader.lines)
    outs = generate_all(addr, prompts[:8], max_tokens[:8])
    assert [list(o.token_ids) for o in outs] == expected[:8]
    deadline = time.monotonic() + 30
    while True:                       # every slot and page given back
        info = decode.info(timeout=10)
        if (info["free_slots"], info["free_pages"]) == (before["free_slots"], before["free_pages"]):
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    router.send_signal(signal.SIGTERM)
    assert router.wait(timeout=60) == 0


def test_sigterm_to_the_whole_role_while_it_compiles_stops_every_process_cleanly(model, procs):
    """The usual way a role is stopped: every process at once, here mid warm-up (the
    leader stops between two compiled steps and tells its follower)."""
    path = model[0]
    group = ["--role", "prefill", "--mesh", "prefill=4", "--model", path, "--port", "0",
             "--num_processes", "2", "--coordinator", coordinator(), "--max_model_len",
             "160", "--host", "127.0.0.1"]
    leader = procs.start(group + ["--process_id", "0"])
    follower = procs.start(group + ["--process_id", "1"])
    procs.wait_line(leader, r"compiling 2/\d+: prefill")
    for p in (leader, follower):
        p.send_signal(signal.SIGTERM)
    assert leader.wait(timeout=60) == 0, "".join(leader.lines)
    assert follower.wait(timeout=60) == 0, "".join(follower.lines)
    assert any("prefill follower 1 stopped" in line for line in follower.lines)


def test_follower_of_another_checkpoint_refuses_to_join_and_says_so(model, hf_models, procs,
                                                                    tmp_path):
    """Two processes of one prefill mesh, the follower's checkpoint with one k_proj
    weight negated (every shape the same): the follower refuses to join, naming both
    fingerprints, and the leader's role stops rather than compute with mixed weights."""

    path, hf = hf_models("llama_tied")
    other = str(tmp_path / "other")
    negated_copy(hf, other)
    group = ["--role", "prefill", "--mesh", "prefill=4", "--port", "0", "--num_processes",
             "2", "--coordinator", coordinator(), "--max_model_len", "160", "--host",
             "127.0.0.1", "--nowarmup", "--follower_timeout_s", "3"]
    leader = procs.start(group + ["--model", path, "--process_id", "0"])
    follower = procs.start(group + ["--model", other, "--process_id", "1"])
    assert follower.wait(timeout=120) == 1, "".join(follower.lines)
    assert leader.wait(timeout=60) == 1, "".join(leader.lines)
    # Both sides compare; the leader stops only once its follower has compared too, so
    # the follower names both fingerprints rather than dying with the coordinator.
    assert any(re.search(r"prefill follower 1 stopped: refusing to join: this follower's "
                         r"checkpoint differs from its leader's \(model fingerprint \w{12}, "
                         r"the leader's \w{12}\)", line)
               for line in follower.lines), "".join(follower.lines)
    assert any(re.search(r"follower process 1's checkpoint differs from this leader's \(model "
                         r"fingerprint \w{12}, the leader's \w{12}\)", line)
               for line in leader.lines), "".join(leader.lines)
    assert not any("worker on" in line for line in leader.lines)
