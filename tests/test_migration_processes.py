"""Live migration across processes: router, a prefill worker and two decode workers
(`python -m jaxpd.launch`, `--migrate_on_drain` left at its default: on) on the
default KV transport, the JAX transfer server (the in-process tests move KV over the
gRPC stream). SIGTERM to the decode
worker holding streams moves them to the other one with their KV: every stream
finishes with transformers' greedy tokens, the prefill worker computes no prompt again,
the drained worker says so in its heartbeat and leaves holding no page, and the other
gives every page back."""
import re
import signal
import threading
import time

import grpc
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.role_rpc import RoleClient
from tests.engine_fixtures import reference
from tests.support.deployments import PATIENT_ROUTER, deployment, stream_tokens

pytestmark = pytest.mark.slow

PATIENT_DRAIN = ["--shutdown_timeout_s", "60"]      # the moves' deadline: a loaded machine


def _greedy(prompt, max_tokens):
    return jaxpd_pb2.GenerateRequest(token_ids=jaxpd_pb2.TokenIds(ids=prompt),
                                     max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_sigterm_migrates_a_decode_workers_streams_across_processes(tiny_hf_model, procs):
    path, hf = tiny_hf_model
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(12 + 9 * i)] for i in range(4)]
    max_tokens = [150 - len(p) for p in prompts]
    expected = reference(hf, prompts, max_tokens)
    addr, router, workers = deployment(procs, path, num_decode=2,
                                       extra=PATIENT_DRAIN, router_extra=PATIENT_ROUTER)
    clients = [RoleClient(procs.wait_line(w, r"worker on (\S+)").group(1)) for w in workers]
    prefill, decoders = clients[0], clients[1:]
    outs = [[] for _ in prompts]
    channel = grpc.insecure_channel(addr)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    streams = [threading.Thread(target=stream_tokens, args=(stub, _greedy(p, n), o))
               for p, n, o in zip(prompts, max_tokens, outs)]
    try:
        for t in streams:
            t.start()
        deadline = time.monotonic() + 240
        while min(map(len, outs)) < 2:               # every prompt prefilled, decoding
            assert time.monotonic() < deadline, procs.tails()
            time.sleep(0.01)
        held = [0]
        while max(held) == 0:                        # a decoder's slots are seen taken
            assert time.monotonic() < deadline, procs.tails()
            busy = [d.info(timeout=10) for d in decoders]
            held = [i["slots_total"] - i["free_slots"] for i in busy]
        victim = held.index(max(held))
        before = prefill.info(timeout=10)["counters"]["prefill_tokens"]
        assert before == sum(map(len, prompts))
        workers[1 + victim].send_signal(signal.SIGTERM)
        for t in streams:
            t.join(300)
        for out, exp in zip(outs, expected):
            assert out == exp + ["length"], procs.tails()
        assert workers[1 + victim].wait(timeout=120) == 0
        drained = procs.wait_line(workers[1 + victim], r"decode worker drained: (\d+) requests "
                                  r"moved out, (\d+) moves failed, (\d+) dropped unasked; "
                                  r"(\d+) slots and (\d+) pages still in use")
        moved = int(drained.group(1))
        assert moved >= 1 and drained.groups()[1:] == ("0", "0", "0", "0")
        procs.wait_line(router, r"decode worker \S+ drains \(this decode worker is shutting "
                        r"down\): chosen for nothing new")
        # No prompt computed again: the moved requests' KV came along.
        assert prefill.info(timeout=10)["counters"]["prefill_tokens"] == before
        stats = stub.Stats(jaxpd_pb2.StatsRequest(), timeout=30)
        assert (stats.migrations, stats.migration_fallbacks) == (moved, 0)
        assert stats.decode_failovers == 0 and stats.aborted == 0
        target = decoders[1 - victim]
        info = target.info(timeout=10)
        assert info["counters"]["transfers"] >= moved
        deadline = time.monotonic() + 30
        while (info["free_slots"], info["free_pages"]) != (info["slots_total"],
                                                           info["pages_total"]):
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
            info = target.info(timeout=10)
        assert re.search(r"moved \S+ \(\d+ tokens of KV\)", "".join(workers[1 + victim].lines))
    finally:
        channel.close()
        for c in clients:
            c.close()
