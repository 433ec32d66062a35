"""The gRPC service end to end: a real server on a loopback port over a tiny HF model
(with a tiny word-level tokenizer, so text prompts work too), driven by the generated
stubs; plus `python -m jaxpd.launch` as a subprocess and the client CLI."""
import contextlib
import inspect
import io
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from absl import flags
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
    ProtoReflectionDescriptorDatabase

from jaxpd import LLM, SamplingParams
from jaxpd.serving import client, launch
from jaxpd.serving.admission import AdmissionController
from jaxpd.config import EngineConfig
from jaxpd.outputs import RequestMetrics
from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.server import SERVICE_NAME, InferenceServer
from tests.engine_fixtures import assert_all_pages_free, mixed_prompts, wait_idle
from tests.support.server_model import VOCAB, build_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def gen_request(ids=None, prompt=None, **fields) -> jaxpd_pb2.GenerateRequest:
    msg = jaxpd_pb2.GenerateRequest(**fields)
    if ids is not None:
        msg.token_ids.ids.extend(ids)
    if prompt is not None:
        msg.prompt = prompt
    return msg


def collect(stub, msg, **kw):
    """(all token ids, text, last response) of one Generate stream."""
    responses = list(stub.Generate(msg, **kw))
    return ([t for r in responses for t in r.token_ids], "".join(r.text for r in responses),
            responses[-1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("served_llama")))


@pytest.fixture(scope="module")
def llm(model_dir):
    messages = []
    with LLM(model_dir, mesh="prefill=1,decode=1", max_model_len=128, max_prefill_batch=4,
             slots_per_shard=8, warmup=True, progress=messages.append) as llm:
        assert any(re.match(r"compiling \d+/\d+: prefill", m) for m in messages)
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    server = InferenceServer(port=0, metrics_port=0)
    server.attach(llm)
    yield server
    server.stop(grace_s=1)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return jaxpd_pb2_grpc.GenerationStub(channel)


@contextlib.contextmanager
def prefill_blocked(llm):
    """Hold every prefill until the block ends, so requests behind the first pile up
    as WAITING. Yields an event set once the first prefill is being held. (The prefill
    mesh's prefix cache runs its batches when it is on.)"""
    runner = llm.engine.prefill_cache or llm.engine.prefill_runner
    run, entered, release = runner.run, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        release.wait(timeout=60)
        return run(*args, **kwargs)

    runner.run = held
    try:
        yield entered
    finally:
        release.set()
        del runner.run     # back to the class's method


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---- serving ------------------------------------------------------------------------

@pytest.mark.slow
def test_concurrent_streams_match_llm_generate(llm, stub):
    prompts = mixed_prompts(32, VOCAB, seed=1)
    max_tokens = [3 + (5 * i) % 25 for i in range(32)]
    expected = [o.token_ids for o in llm.generate(
        prompt_token_ids=prompts, sampling_params=[greedy(n) for n in max_tokens])]
    msgs = [gen_request(p, max_tokens=n, temperature=0.0, ignore_eos=True)
            for p, n in zip(prompts, max_tokens)]
    with futures.ThreadPoolExecutor(32, thread_name_prefix="test-client") as pool:
        results = list(pool.map(lambda m: collect(stub, m, timeout=120), msgs))
    for (ids, text, last), exp in zip(results, expected):
        assert ids == exp
        assert last.finish_reason == "length"
        assert text == llm.tokenizer.decode(exp)
        assert last.metrics.HasField("ttft_s") and last.metrics.transfer_bytes > 0
        assert not last.metrics.HasField("abort_reason")
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_text_prompt_streams_and_completes_like_llm(llm, stub):
    prompt = "the quick brown fox"
    out = llm.generate(prompt, greedy(12))[0]
    ids, text, last = collect(stub, gen_request(prompt=prompt, max_tokens=12, temperature=0.0,
                                                ignore_eos=True))
    assert ids == out.token_ids and text == out.text and last.finish_reason == "length"
    done = stub.Complete(gen_request(prompt=prompt, max_tokens=12, temperature=0.0,
                                     ignore_eos=True))
    assert list(done.token_ids) == out.token_ids and done.text == out.text
    assert list(done.prompt_token_ids) == llm.tokenizer.encode(prompt)
    assert done.finish_reason == "length" and done.metrics.HasField("tpot_s")


@pytest.mark.slow
def test_stop_token_and_seeded_sampling(llm, stub):
    ids = [5, 9, 11, 13]
    first = collect(stub, gen_request(ids, max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    ids_stop, _, last = collect(stub, gen_request(ids, max_tokens=10, temperature=0.0,
                                                  stop_token_ids=[first[3]], ignore_eos=True))
    assert last.finish_reason == "stop" and ids_stop == first[:first.index(first[3]) + 1]
    sampled = lambda seed: collect(stub, gen_request(ids, max_tokens=15, temperature=0.9,
                                                     top_p=0.9, top_k=40, seed=seed,
                                                     ignore_eos=True))[0]
    expected = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=15, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True))[0]
    assert sampled(7) == expected.token_ids


@pytest.mark.slow
def test_tokenize_and_model_info(llm, stub):
    assert list(stub.Tokenize(jaxpd_pb2.TokenizeRequest(text="the lazy dog")).token_ids) == \
        llm.tokenizer.encode("the lazy dog")
    info = stub.ModelInfo(jaxpd_pb2.ModelInfoRequest())
    assert info.vocab_size == VOCAB and info.max_model_len == 128 and info.max_prompt_len == 127
    assert info.mesh == "prefill=1,decode=1" and list(info.eos_token_ids) == [2]
    assert info.has_tokenizer and info.model_path == llm.model_path and info.page_size == 16
    assert info.fingerprint == llm.fingerprint[:12] and len(info.fingerprint) == 12


# ---- bad input ----------------------------------------------------------------------

BAD = [
    (dict(), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="   "), "prompt"),
    (dict(ids=[]), "token_ids"),
    (dict(ids=[1, VOCAB]), "token_ids"),
    (dict(ids=[1, -5]), "token_ids"),
    (dict(ids=list(range(1, 129))), "max_prompt_len"),
    (dict(prompt=" ".join(["fox"] * 130)), "max_prompt_len"),
    (dict(ids=[1, 2], max_tokens=0), "max_tokens"),
    (dict(ids=[1, 2], max_tokens=-3), "max_tokens"),
    (dict(ids=[1, 2], max_tokens=2**62), "max_tokens"),
    (dict(ids=[1, 2], max_tokens=127), "max_tokens"),
    (dict(ids=[1, 2], temperature=math.nan), "temperature"),
    (dict(ids=[1, 2], temperature=-1.0), "temperature"),
    (dict(ids=[1, 2], temperature=math.inf), "temperature"),
    (dict(ids=[1, 2], top_p=0.0), "top_p"),
    (dict(ids=[1, 2], top_p=1.5), "top_p"),
    (dict(ids=[1, 2], top_p=math.nan), "top_p"),
    (dict(ids=[1, 2], top_k=-1), "top_k"),
    (dict(ids=[1, 2], top_k=2**40), "top_k"),
    (dict(ids=[1, 2], seed=-1), "seed"),
    (dict(ids=[1, 2], stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
    (dict(ids=[1, 2], stop_token_ids=[-2]), "stop_token_ids"),
    (dict(ids=[1, 2], request_id=""), "request_id"),
    (dict(ids=[1, 2], request_id="x" * (1 << 20)), "request_id"),
    (dict(ids=[1, 2], request_id="a\x00\x1b[2J"), "request_id"),
    (dict(ids=[1, 2], stop_token_ids=[3] * 257), "stop_token_ids"),
    (dict(prompt="fox " * 20_000), "max_prompt_bytes"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fields,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(stub, fields, field):
    for call in (lambda m: list(stub.Generate(m)), stub.Complete):
        with pytest.raises(grpc.RpcError) as err:
            call(gen_request(**fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()


@pytest.mark.slow
def test_server_keeps_serving_after_bad_input_and_pages_are_free(llm, stub):
    assert collect(stub, gen_request([3, 4], max_tokens=4, temperature=0.0))[2].finish_reason
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_oversized_prompt_is_refused_untokenized_while_a_small_request_streams(llm, stub,
                                                                            monkeypatch):
    encoded, encode = [], llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode",
                        lambda text: encoded.append(len(text)) or encode(text))
    big = "the quick brown fox jumps over the lazy dog " * 88_000    # 3.9 MB
    with futures.ThreadPoolExecutor(1, thread_name_prefix="test-client") as pool:
        small = stub.Generate(gen_request(prompt="the lazy dog", max_tokens=8, temperature=0.0,
                                          ignore_eos=True), timeout=60)
        first = next(small)
        refused = pool.submit(lambda: list(stub.Generate(gen_request(prompt=big), timeout=60)))
        rest = list(small)
        with pytest.raises(grpc.RpcError) as err:
            refused.result(timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is longer than max_prompt_bytes=65536" in err.value.details()
    assert [t for r in [first] + rest for t in r.token_ids] == \
        llm.generate("the lazy dog", greedy(8))[0].token_ids
    assert max(encoded) < 65536   # the big prompt never reached the tokenizer
    assert_all_pages_free(llm)


# ---- cancellation, deadline, overload -------------------------------------------------

@pytest.mark.slow
def test_client_cancel_aborts_and_frees_pages(llm, stub):
    aborted = llm.stats()["aborted"]
    call = stub.Generate(gen_request([7, 8, 9] * 10, max_tokens=95, temperature=0.0,
                                     ignore_eos=True))
    for n, _ in enumerate(call):
        if n == 3:
            call.cancel()
            break
    wait_for(lambda: llm.stats()["aborted"] == aborted + 1, what="the abort")
    assert call.code() == grpc.StatusCode.CANCELLED
    assert_all_pages_free(llm)


def spy_aborts(llm, monkeypatch) -> list:
    """Record every (request_id, reason) the server aborts with."""
    aborts, abort = [], llm.abort
    monkeypatch.setattr(llm, "abort", lambda rid, reason="cancelled":
                        aborts.append((rid, reason)) or abort(rid, reason))
    return aborts


@pytest.mark.slow
def test_deadline_aborts_at_once(llm, stub, monkeypatch):
    aborts = spy_aborts(llm, monkeypatch)
    with prefill_blocked(llm):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gen_request([1, 2, 3], max_tokens=5, request_id="late"),
                               timeout=0.3))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The engine runs it under its own id (the client's is only echoed).
        wait_for(lambda: [reason for _, reason in aborts] == ["deadline exceeded"],
                 what="the deadline abort")
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_full_queue_is_resource_exhausted(llm, stub, monkeypatch):
    monkeypatch.setattr(llm.engine.requests, "max_queued", 1)
    before = stub.Stats(jaxpd_pb2.StatsRequest())
    with futures.ThreadPoolExecutor(2, thread_name_prefix="test-client") as pool:
        with prefill_blocked(llm) as prefilling:
            first = pool.submit(collect, stub, gen_request([1, 2, 3], max_tokens=3,
                                                              ignore_eos=True))
            assert prefilling.wait(timeout=30)
            second = pool.submit(collect, stub, gen_request([4, 5], max_tokens=3,
                                                               ignore_eos=True))
            wait_for(lambda: llm.stats()["queue_waiting"] == 1, what="a waiting request")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(gen_request([6, 7], max_tokens=3)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queued=1" in err.value.details()
        assert first.result(timeout=60)[2].finish_reason == "length"
        assert second.result(timeout=60)[2].finish_reason == "length"
    after = stub.Stats(jaxpd_pb2.StatsRequest())
    assert after.rejections_queue_full == before.rejections_queue_full + 1
    assert after.rejections == before.rejections + 1
    assert_all_pages_free(llm)


@pytest.mark.slow
def test_predicted_ttft_above_slo_is_resource_exhausted(llm, monkeypatch):
    # A second server on the same engine, with an SLO no queued request can meet.
    server = InferenceServer(port=0, slo_ttft_ms=1e-3)
    server.attach(llm)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            # Nothing ahead: admitted (and it teaches the predictor).
            assert collect(stub, gen_request([1, 2, 3], max_tokens=2))[2].finish_reason
            assert server.servicer.admission.s_per_token > 0
            with futures.ThreadPoolExecutor(1, thread_name_prefix="test-client") as pool:
                with prefill_blocked(llm):
                    ahead = pool.submit(collect, stub, gen_request([4, 5, 6], max_tokens=2,
                                                                   ignore_eos=True))
                    wait_for(lambda: server.servicer.stats()["requests_in_flight"] == 1,
                             what="the request ahead")
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Complete(gen_request([7, 8], max_tokens=2))
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "predicted TTFT" in err.value.details()
                assert ahead.result(timeout=60)[2].finish_reason == "length"
            stats = stub.Stats(jaxpd_pb2.StatsRequest())
            assert stats.rejections_slo == 1 and stats.rejections == 1
    finally:
        server.stop(grace_s=1)
    assert_all_pages_free(llm)


def test_admission_prediction_learns_the_drain_rate():
    gate = AdmissionController(slo_ttft_s=0.5, smoothing=0.5)
    assert gate.check(1000, 10) is None                     # nothing measured yet
    m = RequestMetrics(queue_s=0.9, prefill_s=0.1, transfer_s=0.0, transfer_bytes=0,
                       ttft_s=1.05, tpot_s=None, itl_s=[], e2e_s=1.1, num_preemptions=0)
    gate.observe(90, 10, m)                                 # 1 s for 100 tokens
    assert gate.s_per_token == pytest.approx(0.01)
    assert gate.predict_ttft_s(40, 10) == pytest.approx(0.55)
    assert gate.check(0, 100) is None                       # nothing ahead: always admitted
    assert gate.check(30, 10) is None                       # 0.45 s
    assert "exceeds the SLO" in gate.check(40, 10)          # 0.55 s
    assert gate.num_rejected == 1
    assert AdmissionController(0).check(10**6, 10) is None   # SLO off
    with pytest.raises(ValueError, match="slo_ttft_s"):
        AdmissionController(math.nan)


# ---- stats, metrics, health, reflection ------------------------------------------------

@pytest.mark.slow
def test_stats_rpc_and_prometheus_endpoint(llm, stub, server):
    collect(stub, gen_request([1, 2, 3, 4], max_tokens=6, temperature=0.0, ignore_eos=True))
    wait_idle(llm)
    stats, engine = stub.Stats(jaxpd_pb2.StatsRequest()), llm.stats()
    for key in ("finished", "aborted", "transfer_bytes", "num_compiled_programs", "preemptions",
                "slots_total", "pages_total", "decode_steps"):
        assert getattr(stats, key) == engine[key], key
    assert stats.pages_used == 0 and stats.queue_waiting == 0 and stats.requests_in_flight == 0
    assert dict(stats.compiled_programs) == engine["compiled_programs"]
    assert stats.HasField("prefill_s_per_token")
    url = f"http://127.0.0.1:{server.metrics_port}"
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    for name in ("jaxpd_ttft_seconds", "jaxpd_tpot_seconds", "jaxpd_itl_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert float(re.search(rf"^{name}_count ([\d.]+)$", text, re.M).group(1)) > 0
        assert f'{name}_bucket{{le="+Inf"}}' in text
    for line in ("# TYPE jaxpd_pages_used gauge", "# TYPE jaxpd_queue_waiting gauge",
                 "# TYPE jaxpd_slots_active gauge", "# TYPE jaxpd_transfer_bytes_total counter",
                 "# TYPE jaxpd_transfer_seconds_total counter",
                 "# TYPE jaxpd_compiled_programs_total counter",
                 'jaxpd_rejections_total{reason="queue_full"}',
                 "# TYPE jaxpd_preemptions_total counter",
                 f"jaxpd_requests_finished_total {float(engine['finished'])!r}",
                 "# TYPE jaxpd_requests_aborted_total counter"):
        assert line in text
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{url}/other", timeout=10)
    assert err.value.code == 404


@pytest.mark.slow
def test_reflection_lists_the_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    assert SERVICE_NAME == "jaxpd.v1.Generation"
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
    methods = {m.name for m in db.FindFileContainingSymbol(SERVICE_NAME).service[0].method}
    assert methods == {"Generate", "Complete", "Tokenize", "ModelInfo", "Stats"}


@pytest.mark.slow
def test_health_serving_only_while_attached_and_shutdown_aborts_in_flight(llm, monkeypatch):
    aborts = spy_aborts(llm, monkeypatch)
    threads_before = set(threading.enumerate())
    server = InferenceServer(port=0, metrics_port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = lambda service: health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert check("") == check(SERVICE_NAME) == NOT_SERVING
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfo(jaxpd_pb2.ModelInfoRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert next(watch).status == NOT_SERVING
            server.attach(llm)
            assert check("") == check(SERVICE_NAME) == SERVING
            assert next(watch).status == SERVING
            # A stream that cannot finish within the grace (its prefill is held) is
            # aborted with reason "shutdown", and still gets its final message saying so.
            with prefill_blocked(llm) as prefilling:
                stream = stub.Generate(gen_request([9] * 20, max_tokens=10,
                                                   request_id="in-flight"))
                assert prefilling.wait(timeout=30)
                server.stop(grace_s=0.2)
                assert next(watch).status == NOT_SERVING
                responses = list(stream)
    finally:
        server.stop(grace_s=0)
    assert responses[-1].request_id == "in-flight" and responses[-1].finish_reason == "abort"
    assert responses[-1].metrics.abort_reason == "shutdown"
    assert [reason for _, reason in aborts] == ["shutdown"]
    assert not [t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith("jaxpd-")]
    assert_all_pages_free(llm)


# ---- the client CLI and the launcher ---------------------------------------------------

@pytest.mark.slow
def test_client_cli_streams_text_and_prints_metrics(llm, server):
    fv = flags.FlagValues()
    client.define_flags(fv)
    fv([sys.argv[0], f"--target=127.0.0.1:{server.port}", "--max_tokens=8",
        "--temperature=0", "--ignore_eos"])
    out, err = io.StringIO(), io.StringIO()
    assert client.run("the lazy dog", fv, out, err) == 0
    assert out.getvalue().strip() == llm.generate("the lazy dog", greedy(8))[0].text
    assert re.search(r"finish_reason=length TTFT=[\d.]+ms TPOT=[\d.]+ms", err.getvalue())
    fv.unparse_flags()
    fv([sys.argv[0], f"--target=127.0.0.1:{server.port}", "--max_tokens=0"])
    assert client.run("the lazy dog", fv, out, err) == 1
    assert "INVALID_ARGUMENT" in err.getvalue()


def test_launch_flags_document_their_defaults_and_match_engine_config():
    fv = flags.FlagValues()
    launch.define_flags(fv)
    fv(["launch"])
    defaults = EngineConfig()
    for name in ("page_size", "slots_per_shard", "max_prefill_batch", "bucket_timeout_ms",
                 "max_queued"):
        assert fv[name].default == getattr(defaults, name), name
    # The dtype is resolved per backend before it reaches EngineConfig: the flag's
    # default is LLM's.
    assert fv["dtype"].default == inspect.signature(LLM).parameters["dtype"].default == "auto"
    # The mesh too is resolved (per platform and device count) before EngineConfig.
    assert fv.mesh == inspect.signature(LLM).parameters["mesh"].default == "auto"
    assert fv.host == "127.0.0.1" and fv.port == 50051
    assert fv.warmup is True and fv.metrics_port == 0 and fv.slo_ttft_ms == 0
    help_text = " ".join(fv.get_help().split())   # unwrapped
    for name in ("model", "mesh", "dtype", "host", "port", "metrics_port", "max_model_len",
                 "page_size", "slots_per_shard", "max_prefill_batch", "bucket_timeout_ms",
                 "max_queued", "slo_ttft_ms", "warmup", "once"):
        assert f"--{name}" in help_text or f"--[no]{name}" in help_text, name
    assert "(default: 'auto')" in help_text and "default: the built-in" in help_text
    env = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}
    assert launch.set_cpu_device_count("prefill=2,decode=2x2", env) == 6
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=6"
    assert launch.set_cpu_device_count("colocated=4", {"JAX_PLATFORMS": "cuda"}) is None


def test_cpus_flag_names_cpu_sets_and_refuses_others_naming_the_flag():
    assert launch.parse_cpus("0") == {0}
    if {0, 1} <= os.sched_getaffinity(0):
        assert launch.parse_cpus("1,0") == launch.parse_cpus("0-1") == {0, 1}
    for bad in ("", "x", "1-0", "0,,1"):
        with pytest.raises(ValueError, match="--cpus"):
            launch.parse_cpus(bad)
    with pytest.raises(ValueError, match="--cpus .* may not use"):
        launch.parse_cpus(str(max(os.sched_getaffinity(0)) + 1))


@pytest.mark.slow
def test_a_pinned_process_runs_xla_on_its_cpus_only():
    """`--cpus 0` before jax starts: the process runs on CPU 0 and XLA:CPU sizes its
    thread pool to it (one Eigen thread), so pinned roles do not share cores."""
    script = ("import os, sys; from jaxpd.serving.launch import pin_cpus; pin_cpus('0'); "
              "import jax, jax.numpy as jnp; x = jnp.ones((256, 256)); (x @ x).block_until_ready(); "
              "names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]; "
              "print(sorted(os.sched_getaffinity(0)), sum(n.startswith('tf_XLAEigen') for n in names))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")[-2]
    assert out == "[0] 1", out


@pytest.mark.slow
def test_launch_serves_until_sigterm_and_exits_zero(model_dir, tmp_path):
    log_path = tmp_path / "launch.log"
    # No device count in XLA_FLAGS: the launcher must ask for the 2 devices itself.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxpd.launch", f"--model={model_dir}",
           "--mesh=prefill=1,decode=1", "--port=0", "--max_model_len=32",
           "--max_prefill_batch=1", "--slots_per_shard=2", "--shutdown_grace_s=1",
           f"--metrics_port={metrics_port}", "--http_port=0",
           f"--compilation_cache_dir={tmp_path / 'xla'}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        port = None
        deadline = time.monotonic() + 180
        while port is None or "jaxpd serving" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())
            port = port or (found and int(found.group(1)))
            time.sleep(0.1)
        text = log_path.read_text()
        assert re.search(r"compiling \d+/\d+: prefill", text)
        assert re.search(r"compiling \d+/\d+: decode step", text)
        # every compiled program was written to the persistent cache (a restart loads them)
        assert len(os.listdir(tmp_path / "xla")) >= 3
        assert f"jaxpd serving {model_dir} on 127.0.0.1:{port} (mesh prefill=1,decode=1)" in text
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                timeout=10).status == SERVING
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            out = stub.Complete(gen_request(prompt="a small model", max_tokens=4), timeout=60)
            assert len(out.token_ids) == 4 or out.finish_reason == "stop"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert "jaxpd_ttft_seconds_count 1.0" in r.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        assert "threads still running" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- races ----------------------------------------------------------------------------

@pytest.mark.slow
def test_cancels_racing_prefill_transfer_and_admission_leave_the_engine_alive(llm, stub):
    # Last in the module: when this fails the engine is dead for every later test.
    # Cancels land while the request is being prefilled, transferred or admitted to a
    # decode slot (the first token arrives from prefill, before decode has it).
    for i in range(24):
        call = stub.Generate(gen_request([3 + i] * (1 + 4 * i), max_tokens=20, ignore_eos=True))
        if i % 3:
            next(call)
        call.cancel()
    wait_idle(llm)
    assert llm.failure() is None
    assert collect(stub, gen_request([1, 2], max_tokens=3, ignore_eos=True))[2].finish_reason \
        == "length"
    assert_all_pages_free(llm)
