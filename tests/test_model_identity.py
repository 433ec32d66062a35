"""Model identity across roles: a fingerprint of what makes KV interchangeable, and a
prefill and a decode that serve different weights (every shape equal) never paired.

The fingerprint is checked on tiny checkpoints; the deployment tests run a router and
workers of one checkpoint and of a copy with one k_proj weight negated (every shape the
same), as separate processes: mismatched prefill and decode workers, and a rolling
update from one to the other under streaming load.
"""
import dataclasses
import os
import shutil
import time

import grpc
import pytest

from jaxpd.models.config import ModelConfig
from jaxpd.models.fingerprint import model_fingerprint, weights_digest
from jaxpd.serving.role_rpc import RoleClient
from tests.engine_fixtures import mixed_prompts, reference
from tests.support.checkpoints import negated_copy
from tests.support.deployments import COMMON, free_port, generate_all


def fingerprint(path, **kwargs):
    args = dict(kv_dtype="float32", page_size=16, kv_transfer_dtype=None)
    return model_fingerprint(path, ModelConfig.from_dir(path), **{**args, **kwargs})


def test_fingerprint_tells_other_weights_dtype_and_pages_apart(tiny_hf_model, tmp_path,
                                                               monkeypatch):
    path, hf = tiny_hf_model
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path / "cache"))
    same = str(tmp_path / "same")
    shutil.copytree(path, same)
    base = fingerprint(path)
    assert len(base) == 64 and fingerprint(path) == base
    assert fingerprint(same) == base                     # another path, the same files
    other = str(tmp_path / "other")
    negated_copy(hf, other)
    assert os.path.getsize(os.path.join(other, "model.safetensors")) == \
        os.path.getsize(os.path.join(path, "model.safetensors"))
    assert fingerprint(other) != base
    for change in (dict(kv_dtype="bfloat16"), dict(page_size=32),
                   dict(kv_transfer_dtype="int8")):
        assert fingerprint(path, **change) != base, change
    # Weights held quantized, and multiplied with int8 activations, are other numbers;
    # int8 activations change nothing for float weights (they have no such product).
    q8 = fingerprint(path, quantization="int8")
    assert len({base, q8, fingerprint(path, quantization="int8", activations="int8")}) == 3
    assert fingerprint(path, activations="int8") == base


def test_fingerprint_names_a_window_or_experts_only_where_the_config_sets_them(
        tiny_hf_model, tmp_path, monkeypatch):
    path, _ = tiny_hf_model
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path / "cache"))
    cfg = ModelConfig.from_dir(path)
    plain = model_fingerprint(path, cfg, "float32", 16)
    # Defaults spelled out leave it as it was: models without the fields keep theirs.
    same = dataclasses.replace(cfg, sliding_window=None, qk_norm=False)
    assert model_fingerprint(path, same, "float32", 16) == plain
    windowed = dataclasses.replace(cfg, sliding_window=8,
                                   sliding_layers=(True,) * cfg.num_layers)
    normed = dataclasses.replace(cfg, qk_norm=True)
    prints = {model_fingerprint(path, c, "float32", 16) for c in (windowed, normed)}
    assert len(prints) == 2 and plain not in prints


def test_weights_digest_is_cached_and_follows_a_rewritten_file(tiny_hf_model, tmp_path):
    path, hf = tiny_hf_model
    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    shutil.copytree(path, ckpt)
    first = weights_digest(ckpt, cache)
    assert len(os.listdir(cache)) == 1
    assert weights_digest(ckpt, cache) == first         # answered from the cache
    # The same size, other bytes, a later mtime: read again, never the stale digest.
    time.sleep(0.01)
    negated_copy(hf, ckpt)
    assert weights_digest(ckpt, cache) != first
    assert len(os.listdir(cache)) == 2


@pytest.mark.slow
def test_prefill_and_decode_of_other_weights_are_never_paired(tiny_hf_model, procs,
                                                              tmp_path):
    """The issue's setup: /health said ok and the answer was gibberish. Now the router
    never sends the prefill worker's KV to the decode worker of other weights: every
    request is prefilled by the decode worker itself and its tokens are exactly that
    model's greedy tokens; the prefill worker computes nothing; health names the idle
    prefill worker's model."""

    path, hf = tiny_hf_model
    other_path = str(tmp_path / "other")
    other = negated_copy(hf, other_path)
    prompts = mixed_prompts(4, 64, seed=7)
    max_tokens = [5] * len(prompts)
    expected = reference(other, prompts, max_tokens)
    assert expected != reference(hf, prompts, max_tokens)   # the weights do matter

    port = free_port()
    router = procs.start(["--role", "router", "--model", path, "--port", str(port),
                          "--internal_port", "0"] + COMMON)
    internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
    http = procs.wait_line(router, r"HTTP .* on (\S+)").group(1)
    common = COMMON + ["--kv_transport", "grpc", "--router", internal, "--port", "0"]
    prefill = procs.start(["--role", "prefill", "--mesh", "prefill=1", "--model", path]
                          + common)
    decode = procs.start(["--role", "decode", "--mesh", "decode=1", "--model", other_path]
                         + common)
    addresses = [procs.wait_line(w, r"worker on (\S+)").group(1) for w in (prefill, decode)]
    for a in addresses:
        procs.wait_line(router, rf"worker {a} joined")
    procs.wait_line(router, r"jaxpd serving")
    results = generate_all(f"127.0.0.1:{port}", prompts, max_tokens)
    assert [list(r.token_ids) for r in results] == expected, procs.tails()

    import json
    import urllib.request
    with urllib.request.urlopen(f"{http}/health", timeout=10) as reply:
        health = json.loads(reply.read())
    assert health["status"] == "ok" and len(health["fingerprint"]) == 12
    assert any("no decode worker serving the same model" in p for p in health["problems"])
    infos = []
    for a in addresses:
        client = RoleClient(a)
        try:
            infos.append(client.info(timeout=10))
        finally:
            client.close()
    prefill_info, decode_info = infos
    assert prefill_info["model"] != decode_info["model"]
    assert health["fingerprint"] == decode_info["model"][:12]
    assert prefill_info["transfers"] == 0 and decode_info["transfers"] == 0
    assert decode_info["counters"]["handoffs_model_mismatch"] == 0
    assert decode_info["free_pages"] == decode_info["pages_total"]      # no page leaked


@pytest.mark.slow
def test_rolling_update_under_streaming_load_keeps_every_stream_on_one_version(
        tiny_hf_model, procs, tmp_path):
    """v1 (a prefill and a decode worker) serves streams without pause; v2's workers
    (other weights, the same shapes) join; new streams move to v2 once both its roles
    are live; v1's workers are then stopped (and exit cleanly). Every stream finishes,
    each with exactly the greedy tokens of one version alone; v2's decode worker holds
    no page after."""
    import signal
    import threading

    from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc

    path, hf = tiny_hf_model
    v2_path = str(tmp_path / "v2")
    v2 = negated_copy(hf, v2_path)
    prompts = mixed_prompts(3, 48, seed=9)
    max_tokens = 24
    expected = {"v1": reference(hf, prompts, [max_tokens] * 3),
                "v2": reference(v2, prompts, [max_tokens] * 3)}
    assert all(a != b for a, b in zip(expected["v1"], expected["v2"]))

    port = free_port()
    router = procs.start(["--role", "router", "--model", path, "--port", str(port),
                          "--internal_port", "0"] + COMMON)
    internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
    common = COMMON + ["--kv_transport", "grpc", "--router", internal, "--port", "0"]

    def pair(model):
        workers = [procs.start(["--role", role, "--mesh", f"{role}=1", "--model", model]
                               + common) for role in ("prefill", "decode")]
        return workers, [procs.wait_line(w, r"worker on (\S+)").group(1) for w in workers]

    def fingerprint_of(address):
        client = RoleClient(address)
        try:
            return client.info(timeout=10)["model"]
        finally:
            client.close()

    v1_procs, v1_addresses = pair(path)
    procs.wait_line(router, r"jaxpd serving")
    done, stop = [], threading.Event()

    def load(k):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            i = k
            while not stop.is_set():
                i = (i + 1) % len(prompts)
                request = jaxpd_pb2.GenerateRequest(
                    token_ids=jaxpd_pb2.TokenIds(ids=prompts[i]), max_tokens=max_tokens,
                    temperature=0.0, ignore_eos=True)
                tokens, finish = [], None
                for reply in stub.Generate(request, timeout=120):
                    tokens += reply.token_ids
                    if reply.HasField("finish_reason"):
                        finish = reply.finish_reason
                done.append((i, tokens, finish))
    clients = [threading.Thread(target=load, args=(k,)) for k in range(3)]
    for c in clients:
        c.start()
    try:
        _wait_for(lambda: len(done) >= 3)
        v2_procs, v2_addresses = pair(v2_path)
        v2_model = fingerprint_of(v2_addresses[1])
        procs.wait_line(router, rf"new requests go to model {v2_model[:12]}")
        switched = len(done)
        _wait_for(lambda: len(done) >= switched + 6)       # streams that began on v2
        for p in v1_procs:                                  # v1 retires
            p.send_signal(signal.SIGTERM)
        for p in v1_procs:
            assert p.wait(timeout=60) == 0
        after = len(done)
        _wait_for(lambda: len(done) >= after + 3)
    finally:
        stop.set()
        for c in clients:
            c.join(150)
    versions = []
    for i, tokens, finish in done:
        assert finish == "length", (i, tokens, finish, procs.tails())
        version = next((v for v in expected if expected[v][i] == tokens), None)
        assert version is not None, (i, tokens, expected, procs.tails())
        versions.append(version)
    assert "v1" in versions and "v2" in versions
    assert versions[-3:] == ["v2"] * 3                     # after v1 retired
    decode = RoleClient(v2_addresses[1])
    try:
        info = decode.info(timeout=10)
    finally:
        decode.close()
    assert info["free_pages"] == info["pages_total"] and info["transfers"] > 0
    assert info["counters"]["handoffs_model_mismatch"] == 0


def _wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
