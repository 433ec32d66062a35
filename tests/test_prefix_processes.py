"""Prefix caching across processes: a router, a prefill worker and a decode
worker as separate processes on 127.0.0.1, every one with `--enable_prefix_caching`.
Greedy tokens equal transformers'; each side's cache shows in its counters; nothing
is held afterwards."""
import threading
import time

import grpc
import numpy as np
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.role_rpc import RoleClient
from tests.hf_fixtures import hf_greedy
from tests.support.deployments import deployment
from tests.support.prefix_chats import conversation

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


def _complete(stub, ids) -> list[int]:
    req = jaxpd_pb2.GenerateRequest(token_ids=jaxpd_pb2.TokenIds(ids=ids), max_tokens=MAX_TOKENS,
                                    temperature=0.0, ignore_eos=True)
    return list(stub.Complete(req, timeout=120).token_ids)


def test_chats_across_processes_match_transformers_with_both_caches(tiny_hf_model, procs):
    """Two chats of three turns at once, every turn through the prefill process
    (`--prefix_extend_below 0`). The prefill process computes only what its own cache
    lacks, the decode process is sent only the pages it lacks, and every answer equals
    transformers'. Afterwards the decode worker holds no slot and no page."""
    path, hf_model = tiny_hf_model
    caching = ["--enable_prefix_caching", "--prefix_extend_below", "0"]
    addr, _, workers = deployment(procs, path, extra=caching, router_extra=caching)
    rng = np.random.default_rng(9)
    # A long system prompt, so that a turn's new tokens fit a quarter of its bucket
    # and the prefill process's hits pay (`PrefillLoop._run_cached`).
    chats = [conversation(rng, turns=3, system_len=100) for _ in range(2)]
    errors, prompt_tokens = [], []

    def chat(system, users):
        try:
            with grpc.insecure_channel(addr) as channel:
                stub = jaxpd_pb2_grpc.GenerationStub(channel)
                conv = list(system)
                for user in users:
                    conv += user
                    prompt_tokens.append(len(conv))
                    out = _complete(stub, conv)
                    assert out == hf_greedy(hf_model, conv, MAX_TOKENS)
                    conv += out
        except BaseException as e:      # noqa: BLE001 -- re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=chat, args=c) for c in chats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]
    prefill, decode = (RoleClient(procs.wait_line(w, r"worker on (\S+)").group(1))
                       for w in workers)
    p_info, d_info = prefill.info(timeout=10), decode.info(timeout=10)
    p, d = p_info["counters"], d_info["counters"]
    # Without a warm-up nothing compiles in the background: first use compiles.
    assert p_info["compiles_pending"] == d_info["compiles_pending"] == 0
    total = sum(prompt_tokens)
    assert p["prefill_cache_query_tokens"] == total
    assert 0 < p["prefill_cache_hit_tokens"] and p["prefill_tokens"] == (
        total - p["prefill_cache_hit_tokens"])
    assert d["prefix_saved_bytes"] > 0 and d["prefix_skip_misses"] == 0
    assert d["transfers"] == 6 and d["finished"] == 6 and d["aborted"] == 0
    deadline = time.monotonic() + 30
    while True:                                       # the last step's release lands
        info = decode.info(timeout=10)
        if info["free_slots"] == info["slots_total"] and info["free_pages"] == info["pages_total"]:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
