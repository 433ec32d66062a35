"""Prefill and decode in separate processes, KV moved by the JAX transfer server."""
import json
import os
import subprocess
import sys
import time

import pytest

from jaxpd.config import EngineConfig
from jaxpd.engine.engine import Engine
from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.models import checkpoint
from tests.engine_fixtures import mixed_prompts, reference
from jaxpd.transfer import jax_compat
from jaxpd.transfer.transfer_server import TransferServerOptions, TransferServerReceiver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM = 10
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax_compat.unavailable_reason() is not None,
                                 reason=str(jax_compat.unavailable_reason()))]


@pytest.fixture(scope="module")
def model(tiny_hf_model):
    path, hf = tiny_hf_model
    prompts = mixed_prompts(NUM, 256, seed=3)
    max_tokens = [4 + 3 * i for i in range(NUM)]
    return path, prompts, max_tokens, reference(hf, prompts, max_tokens)


def _run(model, tmp_path, mode, slots_per_shard=4, pull_timeout_s=10.0):
    path, prompts, max_tokens, expected = model
    connector = TransferServerReceiver(options=TransferServerOptions(
        pull_timeout_s=pull_timeout_s))
    engine = Engine(checkpoint.load(path), EngineConfig(mesh="decode=2", max_model_len=160,
                                                        slots_per_shard=slots_per_shard),
                    connector=connector)
    specs = [{"id": f"mp-{i}", "prompt": p,
              "params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}}
             for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    mirrors = []
    for s in specs:
        r = Request(s["id"], s["prompt"], SamplingParams(**s["params"]), state=State.TRANSFERRING)
        engine.register(r)
        mirrors.append(r)
    spec_file = tmp_path / "requests.json"
    spec_file.write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "prefill_process.py"), path,
                             connector.control_address, str(spec_file), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not all(r.is_final for r in mirrors):
            assert time.monotonic() < deadline, [r.state for r in mirrors]
            assert proc.poll() is None or mode == "die_after_offer" or proc.returncode == 0, \
                proc.stderr.read()
            time.sleep(0.02)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while not engine.is_idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert [r.output_ids for r in mirrors] == expected
        assert all(r.finish_reason == "length" for r in mirrors)
        assert stats["pages_used"] == 0 and stats["slots_active"] == 0
        return proc, stats
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.shutdown()


def test_prefill_process_to_decode_process_matches_hf(model, tmp_path):
    proc, stats = _run(model, tmp_path, "normal")
    assert proc.returncode == 0
    assert stats["transfers"] == NUM and stats["transfer_failures"] == 0
    assert stats["local_prefills"] == 0


def test_prefill_process_killed_after_offer_requests_still_finish(model, tmp_path):
    # One slot per shard: most requests wait for a slot (those past the decode side's
    # max_prefetch are not even pulled), so some pulls come after the kill, which follows
    # the last offer at once. A pull from the dead process fails when its timeout runs
    # out: a short one (a pull
    # that times out while the peer lives is a transfer failure too, which the
    # assertions below allow).
    proc, stats = _run(model, tmp_path, "die_after_offer", slots_per_shard=1,
                       pull_timeout_s=2.0)
    assert proc.returncode == -9
    assert stats["transfer_failures"] > 0
    # Whatever was not pulled before the kill was re-prefilled on the decode mesh.
    assert stats["transfers"] + stats["transfer_failures"] == NUM
    assert stats["local_prefills"] == stats["transfer_failures"]
