"""The public server's bounds, probed as an attacker would,
against a real `InferenceServer` over a hand-checkable front end (no jax): requests wait
until the test releases them, then get `max_tokens` copies of one token.

Run them together with `-k "stranger or slowloris or oversized or garbage or shutdown"`.
"""
import json
import re
import secrets
import socket
import threading
import time
import urllib.request
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from jaxpd.config import EngineConfig
from jaxpd.default_model import default_model_dir
from jaxpd.frontend import Frontend
from jaxpd.models.tokenizer import Tokenizer
from jaxpd.serving.pool import ShrinkingThreadPool
from jaxpd.serving.prometheus import MetricsEndpoint, ServingCollector, ServingMetrics
from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.server import SERVICE_NAME, InferenceServer
from jaxpd.validation import MAX_STOP_TOKEN_IDS, MIN_PROMPT_BYTES

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TOKEN = 7


class HeldFrontend(Frontend):
    """Requests wait (WAITING) while `held` is set; `release()` ends every live one with
    `max_tokens` copies of TOKEN. Records every text its tokenizer is given."""

    def __init__(self, held: bool = True):
        self.config = EngineConfig(mesh="colocated=1", max_model_len=64)
        self.model_config = SimpleNamespace(vocab_size=4096, eos_token_ids=(2,))
        self.model_path = default_model_dir()
        self.tokenizer = Tokenizer(default_model_dir())
        self.encoded: list[int] = []   # length of every text tokenized
        encode = self.tokenizer.encode
        self.tokenizer.encode = lambda text: self.encoded.append(len(text)) or encode(text)
        self.held = held
        self.stats_open = threading.Event()   # cleared: stats() waits (a slow back end)
        self.stats_open.set()
        self.live: dict[str, object] = {}
        self._lock = threading.Lock()

    def new_request_id(self) -> str:
        return f"req-{secrets.token_hex(8)}"

    def submit(self, request):
        with self._lock:
            if request.request_id in self.live:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self.live[request.request_id] = request
        if not self.held:
            self._end(request)
        return request

    def abort(self, request_id, reason="cancelled"):
        with self._lock:
            r = self.live.get(request_id)
        return r is not None and r.abort(reason)

    def release(self) -> None:
        self.held = False
        with self._lock:
            live = list(self.live.values())
        for r in live:
            self._end(r)

    def num_waiting(self) -> int:
        with self._lock:
            return sum(not r.is_final for r in self.live.values())

    def stats(self) -> dict:
        self.stats_open.wait(timeout=30)
        return {"queue_waiting": self.num_waiting()}

    def shutdown(self) -> None:
        pass

    @staticmethod
    def _end(r) -> None:
        while not r.is_final:
            r.append_token(TOKEN, time.perf_counter())



def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def gen_request(ids=None, prompt=None, **fields) -> jaxpd_pb2.GenerateRequest:
    msg = jaxpd_pb2.GenerateRequest(**fields)
    if ids is not None:
        msg.token_ids.ids.extend(ids)
    if prompt is not None:
        msg.prompt = prompt
    return msg


@pytest.fixture
def serve():
    """serve(front end or None, **server options) -> (server, channel); all stopped after."""
    opened = []

    def start(frontend, **options):
        server = InferenceServer(port=0, **options)
        if frontend is not None:
            server.attach(frontend)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        opened.append((server, channel))
        return server, channel

    yield start
    for server, channel in opened:
        channel.close()
        server.stop(grace_s=0)


def check_health(channel, service=SERVICE_NAME) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


# ---- finding 10: garbage protobuf ------------------------------------------------------

def test_garbage_protobuf_is_invalid_argument_not_internal(serve):
    server, channel = serve(HeldFrontend())
    truncated = gen_request(prompt="the quick brown fox").SerializeToString()[:-3]
    bad_utf8 = b"\x0a\x02\xff\xfe"           # field 1 (prompt), not UTF-8
    garbage = (b"\xff\xff\xff\xff", truncated)
    for path, streaming, inputs in (("Generate", True, garbage + (bad_utf8,)),
                                    ("Complete", False, garbage + (bad_utf8,)),
                                    ("Tokenize", False, garbage + (bad_utf8,)),
                                    ("ModelInfo", False, garbage), ("Stats", False, garbage)):
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(f"/{SERVICE_NAME}/{path}", request_serializer=None,
                    response_deserializer=None)
        for data in inputs:
            with pytest.raises(grpc.RpcError) as err:
                result = call(data, timeout=10)
                if streaming:
                    list(result)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, data)
            assert "is not a valid jaxpd.v1." in err.value.details()
    assert check_health(channel) == SERVING


# ---- finding 5: request ids ---------------------------------------------------------------

def test_stranger_reusing_my_request_id_neither_collides_nor_reaches_my_request(serve):
    frontend = HeldFrontend()
    server, mine = serve(frontend)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as theirs:
        msg = gen_request([5, 6, 7], max_tokens=3, request_id="shared-id")
        a = jaxpd_pb2_grpc.GenerationStub(mine).Generate(msg, timeout=30)
        b = jaxpd_pb2_grpc.GenerationStub(theirs).Generate(msg, timeout=30)
        wait_for(lambda: frontend.num_waiting() == 2, what="both requests")
        engine_ids = list(frontend.live)
        # The front end runs each under its own unguessable id; the client's id never
        # reaches it, so neither caller can name the other's request.
        assert all(re.fullmatch(r"req-[0-9a-f]{16}", i) for i in engine_ids), engine_ids
        b.cancel()   # the stranger gives up: mine is untouched
        wait_for(lambda: frontend.num_waiting() == 1, what="the stranger's abort")
        frontend.release()
        responses = list(a)
    assert [t for r in responses for t in r.token_ids] == [TOKEN] * 3
    assert responses[-1].finish_reason == "length"
    assert {r.request_id for r in responses} == {"shared-id"}
    # Unset: the response carries the assigned id.
    unset = jaxpd_pb2_grpc.GenerationStub(mine).Complete(gen_request([5], max_tokens=1),
                                                         timeout=30)
    assert re.fullmatch(r"req-[0-9a-f]{16}", unset.request_id)


@pytest.mark.parametrize("request_id", ["x" * (1 << 20), "a\x00b", "\x1b[31mred", "a b",
                                        "x" * 129])
def test_request_id_over_the_length_or_outside_the_charset_is_invalid_argument(serve,
                                                                                request_id):
    frontend = HeldFrontend(held=False)
    server, channel = serve(frontend)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    for call in (lambda m: list(stub.Generate(m, timeout=30)),
                 lambda m: stub.Complete(m, timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call(gen_request([5], max_tokens=1, request_id=request_id))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in err.value.details() and len(err.value.details()) < 200
    assert not frontend.live


# ---- finding 9: bounded work before limits --------------------------------------------------

def test_oversized_prompt_is_refused_before_tokenizing_and_a_small_one_runs(serve):
    frontend = HeldFrontend(held=False)
    server, channel = serve(frontend)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    big = "the quick brown fox jumps over the lazy dog " * 88_000    # 3.9 MB
    with futures.ThreadPoolExecutor(2, thread_name_prefix="test-client") as pool:
        refused = pool.submit(lambda: stub.Complete(gen_request(prompt=big, max_tokens=1),
                                                    timeout=60))
        small = stub.Complete(gen_request(prompt="the lazy dog", max_tokens=4), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            refused.result(timeout=60)
    assert small.finish_reason == "length" and list(small.token_ids) == [TOKEN] * 4
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in err.value.details() and "max_prompt_bytes=65536" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(jaxpd_pb2.TokenizeRequest(text=big), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in err.value.details() and "max_prompt_bytes" in err.value.details()
    # The tokenizer never saw the big text: refusing it cost a length check.
    assert frontend.encoded and max(frontend.encoded) < MIN_PROMPT_BYTES
    # The limit is configurable, and a prompt just under it is tokenized.
    server, channel = serve(frontend, max_prompt_bytes=100)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    assert stub.Tokenize(jaxpd_pb2.TokenizeRequest(text="a" * 100), timeout=30).token_ids
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(jaxpd_pb2.TokenizeRequest(text="\u00e9" * 51), timeout=30)   # 102 bytes
    assert "max_prompt_bytes=100" in err.value.details()


def test_oversized_token_lists_are_refused_naming_the_field(serve):
    frontend = HeldFrontend(held=False)
    server, channel = serve(frontend)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    for fields, field in ((dict(ids=[5] * 1_000_000), "max_prompt_len=63"),
                          (dict(ids=[5], stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)),
                           "stop_token_ids")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(gen_request(max_tokens=1, **fields), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
    assert not frontend.live


def test_tokenizing_a_long_text_lets_other_threads_run():
    """The GIL is released while a text is tokenized (it was held for the whole of a
    3.7 s tokenization, stalling every other request)."""
    tokenizer = Tokenizer(default_model_dir())
    text = "the quick brown fox jumps over the lazy dog " * 10_000    # 0.44 MB
    ticks, done = [0], threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)

    ticker = threading.Thread(target=tick, name="test-ticker")
    ticker.start()
    try:
        wait_for(lambda: ticks[0] > 0, what="the ticker")
        before = ticks[0]
        tokenizer.encode(text)   # about a microsecond a byte
        during = ticks[0] - before
    finally:
        done.set()
        ticker.join()
    assert during > 100, during   # holding the GIL, it was 0 to 3


# ---- finding 7: health never competes with generation ----------------------------------------

def test_health_answers_while_every_generation_slot_is_busy(serve):
    frontend = HeldFrontend()
    server, channel = serve(frontend, max_concurrent_rpcs=2)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    streams = [stub.Generate(gen_request([5], max_tokens=2), timeout=30) for _ in range(2)]
    wait_for(lambda: frontend.num_waiting() == 2, what="two busy streams")
    for _ in range(20):
        assert check_health(channel) == check_health(channel, "") == SERVING
    # Nor do Stats calls stuck on a slow back end hold health up.
    frontend.stats_open.clear()
    stuck = [stub.Stats.future(jaxpd_pb2.StatsRequest(), timeout=30) for _ in range(6)]
    assert check_health(channel) == SERVING
    frontend.stats_open.set()
    assert all(f.result().requests_in_flight == 2 for f in stuck)
    for call in (lambda: list(stub.Generate(gen_request([5], max_tokens=2), timeout=30)),
                 lambda: stub.Complete(gen_request([5], max_tokens=2), timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_rpcs=2" in err.value.details()
    assert check_health(channel) == SERVING
    assert stub.ModelInfo(jaxpd_pb2.ModelInfoRequest(), timeout=10).max_model_len == 64
    stats = stub.Stats(jaxpd_pb2.StatsRequest(), timeout=10)
    assert stats.rejections == 2 and stats.requests_in_flight == 2
    frontend.release()
    assert all(list(s)[-1].finish_reason == "length" for s in streams)


def test_rpc_threads_are_bounded_and_exit_when_idle():
    pool = ShrinkingThreadPool(3, "test-pool", idle_s=0.1)
    gate = threading.Event()
    results = [pool.submit(lambda i=i: gate.wait(30) and i) for i in range(5)]
    wait_for(lambda: pool.num_threads == 3, what="three threads")
    time.sleep(0.2)
    assert pool.num_threads == 3 and sum(f.done() for f in results) == 0
    gate.set()
    assert [f.result(timeout=30) for f in results] == [0, 1, 2, 3, 4]
    wait_for(lambda: pool.num_threads == 0, what="idle threads to exit")
    assert pool.submit(lambda: "again").result(timeout=30) == "again"
    failing = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=30)
    pool.shutdown(wait=True)
    assert pool.num_threads == 0
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_server_streams_hold_no_thread_each_and_idle_threads_exit(serve):
    frontend = HeldFrontend()
    server, channel = serve(frontend, rpc_idle_s=0.2)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    pool_threads = lambda: [t for t in threading.enumerate()
                            if t.name.startswith(("jaxpd-grpc-prep", "jaxpd-grpc-control"))]
    streams = [stub.Generate(gen_request([5], max_tokens=1), timeout=30) for _ in range(40)]
    wait_for(lambda: frontend.num_waiting() == 40, what="a burst of streams")
    assert len(pool_threads()) <= 4          # the submitting pool, not a thread per call
    frontend.release()
    assert all(list(s)[-1].finish_reason == "length" for s in streams)
    wait_for(lambda: not pool_threads(), what="the burst's threads to exit")
    assert check_health(channel) == SERVING   # and a thread comes back when needed


# ---- finding 9: the Prometheus endpoint --------------------------------------------------

@pytest.mark.slow
def test_metrics_slowloris_costs_no_threads_and_scrapes_still_answer():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(ServingMetrics(), lambda: {"pages_used": 3}))
    endpoint = MetricsEndpoint(registry, port=0, timeout_s=0.5, max_connections=150)
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    threads_before = threading.active_count()
    slow = []
    try:
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
            s.sendall(b"GET /metr")   # and never the rest
            slow.append(s)
        wait_for(lambda: endpoint.num_open == 100, what="100 half-open connections")
        assert threading.active_count() <= threads_before + 2
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert "jaxpd_pages_used 3.0" in text and "# TYPE jaxpd_ttft_seconds histogram" in text
        # Each half-open connection is closed once its timeout passes.
        for s in slow:
            assert s.recv(1) == b""
        wait_for(lambda: endpoint.num_open == 0, what="the slow connections to close")
        # Beyond max_connections, a connection is closed at once.
        crowd = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
                 for _ in range(151)]
        slow.extend(crowd)
        assert crowd[-1].recv(1) == b""
    finally:
        for s in slow:
            s.close()
        endpoint.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxpd-metrics")]


# ---- finding 10: shutdown ------------------------------------------------------------------

@pytest.mark.slow
def test_shutdown_ends_streams_with_a_final_message_saying_shutdown(serve):
    frontend = HeldFrontend()
    server, channel = serve(frontend)
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    stream = stub.Generate(gen_request([5], max_tokens=4), timeout=30)
    with futures.ThreadPoolExecutor(2, thread_name_prefix="test-client") as pool:
        unary = pool.submit(stub.Complete, gen_request([5], max_tokens=4), timeout=30)
        wait_for(lambda: frontend.num_waiting() == 2, what="two requests")
        stopping = pool.submit(server.stop, 1.0)
        # During the grace: health says NOT_SERVING and new calls are refused.
        wait_for(lambda: check_health(channel) == NOT_SERVING, what="NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(gen_request([5], max_tokens=1), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        responses = list(stream)
        done = unary.result(timeout=30)
        stopping.result(timeout=30)
    assert responses[-1].finish_reason == "abort"
    assert responses[-1].metrics.abort_reason == "shutdown"
    assert done.finish_reason == "abort" and done.metrics.abort_reason == "shutdown"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jaxpd-")]


def test_public_port_serves_tls_and_refuses_plaintext(tmp_path):
    """--public_tls_cert/--public_tls_key: the public gRPC service speaks TLS; the CLI
    client connects with --tls_ca; a plaintext client gets nothing."""
    import io
    from absl import flags as absl_flags
    from jaxpd.serving import client as client_cli
    from jaxpd.serving.launch import _public_tls, define_flags
    from certs import issue, make_ca

    ca = make_ca(str(tmp_path))
    pem = issue(str(tmp_path), ca, "server")
    fv = absl_flags.FlagValues()
    define_flags(fv)
    fv(["launch", f"--public_tls_cert={pem.cert}", f"--public_tls_key={pem.key}"])
    creds, ssl = _public_tls(fv)
    assert ssl == {"ssl_certfile": pem.cert, "ssl_keyfile": pem.key}
    server = InferenceServer(port=0, tls=creds)
    server.attach(HeldFrontend(held=False))
    try:
        target = f"localhost:{server.port}"
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(
                open(pem.ca, "rb").read())) as channel:
            info = jaxpd_pb2_grpc.GenerationStub(channel).ModelInfo(
                jaxpd_pb2.ModelInfoRequest(), timeout=10)
            assert info.max_model_len > 0
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as e:
            jaxpd_pb2_grpc.GenerationStub(channel).ModelInfo(jaxpd_pb2.ModelInfoRequest(),
                                                             timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        cv = absl_flags.FlagValues()
        client_cli.define_flags(cv)
        cv(["client", f"--target={target}", f"--tls_ca={pem.ca}", "--max_tokens=2",
            "--token_ids=1,2,3"])
        out, err = io.StringIO(), io.StringIO()
        assert client_cli.run(None, cv, out, err) == 0, err.getvalue()
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="both --public_tls_cert"):
        fv2 = absl_flags.FlagValues()
        define_flags(fv2)
        fv2(["launch", f"--public_tls_cert={pem.cert}"])
        _public_tls(fv2)


def _idle_connections_to_open(num_ports: int, wanted: int = 2000, spare: int = 512) -> int:
    """How many idle connections to hold on each of `num_ports` ports. Each costs this
    process two descriptors (the client's socket and the server's accepted one), so the
    soft fd limit is raised to the hard one where needed and the count kept `spare`
    descriptors under it (grpc, jax and the test runner hold some). `wanted` is far
    past every in-flight bound the test sets (8), and is as many as common default
    hard limits (4,096 and up) allow on two ports; a 10,000-connection run is a
    measurement (`launch/stream_load.py --idle`), not a test."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = spare + 2 * num_ports * wanted
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return wanted if soft == resource.RLIM_INFINITY else min(wanted, (soft - spare) // (2 * num_ports))


@pytest.mark.slow
def test_idle_connections_do_not_stop_new_requests_being_served(serve):
    """Thousands of TCP connections that never send a byte, held open on the HTTP port
    and on the public gRPC port at once, take no request slot: a new request on each
    port is still served, although both allow only 8 requests in flight."""
    from jaxpd.serving.http import HttpServer, OpenAIService

    frontend = HeldFrontend(held=False)
    server, channel = serve(frontend, max_concurrent_rpcs=8)
    http = HttpServer(OpenAIService(model_names=("held",), max_concurrent=8), port=0)
    http.attach(frontend)
    num_idle = _idle_connections_to_open(num_ports=2)
    assert num_idle >= 200, "the fd limit leaves too few descriptors for this test"
    idle = []
    try:
        for port in (http.port, server.port):
            for _ in range(num_idle):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        stub = jaxpd_pb2_grpc.GenerationStub(channel)
        reply = stub.Complete(gen_request(ids=[5, 6], max_tokens=3), timeout=60)
        assert list(reply.token_ids) == [TOKEN] * 3 and reply.finish_reason == "length"
        body = json.dumps({"model": "held", "prompt": [5, 6], "max_tokens": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http.port}/v1/completions",
                                         data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 3
        assert all(s.fileno() >= 0 for s in idle)     # still open: none was refused
    finally:
        for s in idle:
            s.close()
        http.stop(grace_s=0)


def test_a_grpc_client_that_stops_reading_is_cut_off_with_the_reason(serve):
    """A client that opens a stream and stops reading: once grpc's flow control holds
    the server's writes, the stream's unread events pass the bound and the request
    aborts itself with the reason, long before its max_tokens; the front end (here the
    test's thread, standing in for the engine) is never blocked."""
    from jaxpd.output_sink import SLOW_READER
    max_tokens = 100_000
    frontend = HeldFrontend()
    frontend.config = EngineConfig(mesh="colocated=1", max_model_len=max_tokens + 64)
    server, _ = serve(frontend)
    server.servicer.max_buffered = 16
    # A small receive window, not grown by bandwidth probes: grpc holds the server's
    # writes after a few KB unread rather than after megabytes.
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[
        ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)])
    stub = jaxpd_pb2_grpc.GenerationStub(channel)
    stream = stub.Generate(gen_request([5], max_tokens=max_tokens), timeout=120)
    wait_for(lambda: frontend.num_waiting() == 1, what="the stream's request")
    (r,) = frontend.live.values()
    num_taken = 0
    while not r.is_final:
        r.append_token(TOKEN, time.perf_counter())
        num_taken += 1
        # Paced like engine steps: the server sends what grpc lets it before the next
        # token (the producer never waits on it for longer than a step).
        step_end = time.monotonic() + 0.05
        while r.events.items and time.monotonic() < step_end:
            time.sleep(0.0002)
    # Taken: what the window and the transport hold (a few dozen messages), plus the bound.
    assert r.abort_reason == SLOW_READER and num_taken < max_tokens // 100
    stream.cancel()
    channel.close()
