"""The internal plane between the router and its workers, in one process: who may call
it, what it accepts, and how it notices dead, frozen or mismatched workers.

The router side runs against fake workers (plain gRPC servers speaking the role RPCs,
no jax); the worker side runs a real tiny engine behind a `RoleServer`.
"""
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpd.auth import NO_AUTH, InternalAuth
from jaxpd.default_model import default_model_dir
from jaxpd.models.config import ModelConfig
from jaxpd.sampling_params import SamplingParams
from jaxpd.serving.role_rpc import (ROLE_SERVICE, ROUTER_SERVICE, RoleClient, WorkerInfo,
                                    register, router_identity, stream_handler, unary_handler)
from jaxpd.serving.router import Router, RouterConfig
from jaxpd.transfer.wire import WIRE_VERSION, pack

from certs import issue, make_ca
from tests.support.internal_plane import AUTH, MAX_MODEL_LEN, TOKEN, start_worker, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _code(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


# ---- fake workers (router side) ----------------------------------------------------------

MODEL_A, MODEL_B = "a" * 64, "b" * 64     # two fingerprints: two model versions


class FakeWorker:
    """A worker that speaks the role RPCs: Decode streams token 7 until max_tokens (or,
    `frozen`, says nothing at all); `hang_info` makes Info never answer."""

    def __init__(self, role="decode", auth=NO_AUTH, model_dir=None, frozen=False,
                 hang_info=False, free_slots=8, token=7, prefill_s=0.0, **overrides):
        model_dir = model_dir or default_model_dir()
        self.frozen, self.hang_info, self.token = frozen, hang_info, token
        self.prefill_s = prefill_s          # how long a Prefill takes (until `release`)
        self.decode_calls = self.prefill_calls = self.reprefill_calls = 0
        self.destinations = []
        self.release = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(8),
                                   interceptors=auth.server_interceptors())
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ROLE_SERVICE, {
            "Info": unary_handler(self.Info), "Decode": stream_handler(self.Decode),
            "Prefill": unary_handler(self.Prefill), "Reprefill": unary_handler(self.Reprefill),
            "Abort": unary_handler(lambda m, c: {"aborted": True})}),))
        port = auth.add_port(self._server, "127.0.0.1:0")
        self._server.start()
        fields = dict(role=role, address=f"127.0.0.1:{port}", kv_address="127.0.0.1:1",
                      model=MODEL_A, tokenizer=router_identity(model_dir), max_model_len=1024,
                      max_prompt_len=1023,
                      vocab_size=ModelConfig.from_dir(model_dir).vocab_size, page_size=16,
                      dtype="float32", kv_transport="grpc")
        self.info = WorkerInfo(**{**fields, **overrides})
        self.load = {"free_slots": free_slots, "free_pages": 100, "queue": 0}
        self._beating = threading.Event()

    def Info(self, msg, context):
        if self.hang_info:
            self.release.wait(30)
        return {**self.info.to_wire(), **self.load}

    def Prefill(self, msg, context):
        self.prefill_calls += 1
        self.destinations.append(msg["destination"])
        self.release.wait(self.prefill_s)
        return {"status": "handed_off"}

    def Reprefill(self, msg, context):
        self.reprefill_calls += 1
        return {"ok": True}

    def Decode(self, msg, context):
        self.decode_calls += 1
        yield {"registered": True}
        if self.frozen:
            self.release.wait(30)
            return
        r = msg["request"]
        for _ in range(r["params"]["max_tokens"] - len(r["output_ids"])):
            yield {"token_ids": [self.token], "finish": None, "abort_reason": None}

    def register(self, router_address, auth=AUTH):
        return register(router_address, self.info, self.load, auth, timeout=5)

    def heartbeat(self, router_address, every_s=0.1):
        self._beating.set()

        def loop():
            while self._beating.is_set():
                try:
                    self.register(router_address)
                except grpc.RpcError:        # the router is gone: so is this fake
                    return
                time.sleep(every_s)
        threading.Thread(target=loop, daemon=True).start()

    def stop_heartbeat(self):
        self._beating.clear()

    def close(self):
        self.stop_heartbeat()
        self.release.set()
        self._server.stop(0)


@pytest.fixture
def fakes():
    made = []

    def make(**kwargs):
        made.append(FakeWorker(**kwargs))
        return made[-1]
    yield make
    for w in made:
        w.close()


def _router(auth=AUTH, **config):
    config = {"max_model_len": 512, "heartbeat_s": 0.1, "lease_s": 0.6,
              "stall_timeout_s": 0.6, **config}
    router = Router(default_model_dir(), RouterConfig(**config), auth=auth)
    port = router.listen("127.0.0.1", 0)
    return router, f"127.0.0.1:{port}"


@pytest.fixture
def router():
    router, address = _router()
    yield router, address
    router.shutdown()


def test_rogue_cannot_register_without_the_token_and_gets_no_requests(router, fakes):
    router, address = router
    rogue = fakes(free_slots=10**9)      # advertises a huge capacity
    for auth in (NO_AUTH, InternalAuth(token="not-the-cluster-token-000")):
        code, _ = _code(lambda: rogue.register(address, auth=auth))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    assert not router.ready() and router.live_workers() == {}
    out = router.generate(prompt_token_ids=[[1, 2, 3]],
                          sampling_params=SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.finish_reason == "abort" and "no decode worker" in out.abort_reason
    assert rogue.decode_calls == 0       # nobody's prompt reached the rogue


def test_rogue_register_on_the_public_port_is_unimplemented(router, fakes):
    from jaxpd.serving.server import InferenceServer
    router, _ = router
    public = InferenceServer("127.0.0.1", 0)
    public.attach(router)
    try:
        with AUTH.channel(f"127.0.0.1:{public.port}") as channel:
            call = channel.unary_unary(f"/{ROUTER_SERVICE}/Register", request_serializer=pack)
            code, _ = _code(lambda: call({"wire_version": WIRE_VERSION, **fakes().info.to_wire()},
                                         timeout=5))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    finally:
        public.stop(0)


def test_registered_worker_serves_and_request_ids_are_unguessable(router, fakes):
    router, address = router
    worker = fakes()
    assert worker.register(address) == {"lease_s": 0.6}
    assert router.ready()
    outs = router.generate(prompt_token_ids=[[1, 2], [3]],
                           sampling_params=SamplingParams(max_tokens=3, **GREEDY))
    assert [o.token_ids for o in outs] == [[7, 7, 7]] * 2
    ids = {router.new_request_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"rt-[0-9a-f]{16}", i) for i in ids)


@pytest.mark.parametrize("override,field", [
    (dict(max_model_len=128, max_prompt_len=127), "max_model_len"),
    (dict(max_prompt_len=100), "max_prompt_len"),
    (dict(tokenizer="0" * 64), "tokenizer"),
    (dict(vocab_size=32000), "vocab_size"),
    (dict(page_size=32), "page_size")])
def test_mismatch_worker_is_refused_naming_the_field(router, fakes, override, field):
    router, address = router
    code, details = _code(lambda: fakes(**override).register(address))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith(f"{field}:"), details
    assert not router.ready()


def test_mismatch_dtype_and_transport_follow_the_first_worker(router, fakes):
    router, address = router
    fakes().register(address)
    for override, field in ((dict(dtype="bfloat16"), "dtype"),
                            (dict(kv_transport="transfer_server"), "kv_transport")):
        code, details = _code(lambda: fakes(**override).register(address))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(field)


@pytest.mark.parametrize("junk", [
    dict(role="bogus"), dict(role=None), dict(address=5), dict(address=""),
    dict(address="x" * 5000), dict(max_model_len="big"), dict(page_size=-1),
    dict(vocab_size=True), dict(kv_transport="carrier pigeon"), dict(load={"free_slots": -1}),
    dict(load=[1, 2]), dict(dtype="\x1b[31m"), dict(prefix="all of them"),
    dict(prefix={"root": b"r", "seq": 1, "full": True, "add": [b"short"], "drop": []}),
    dict(prefix={"root": b"r", "seq": -1, "full": True, "add": [], "drop": []}),
    dict(draining=True), dict(draining=""), dict(draining="x" * 5000),
    dict(draining="\x1b[2J")])
def test_rogue_junk_registration_is_invalid_argument(router, fakes, junk):
    router, address = router
    body = {"wire_version": WIRE_VERSION, **fakes().info.to_wire(), "load": {}, **junk}
    with AUTH.channel(address) as channel:
        call = channel.unary_unary(f"/{ROUTER_SERVICE}/Register", request_serializer=pack)
        code, _ = _code(lambda: call(body, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert router.live_workers() == {}


def test_rogue_garbage_body_is_invalid_argument(router):
    router, address = router
    with AUTH.channel(address) as channel:
        call = channel.unary_unary(f"/{ROUTER_SERVICE}/Register")
        for body in (b"\xc1\xff", b"\x93\x01\x02", b"\xdd\xff\xff\xff\xff"):
            assert _code(lambda: call(body, timeout=5))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_worker_whose_heartbeat_says_draining_gets_no_new_request(router, fakes):
    """A draining worker says so in its heartbeat (and Info): the router sends it
    nothing new from that beat on, while it stays live for the calls it has open, and
    chooses it again once a beat no longer says it."""
    router, address = router
    draining, spare = fakes(free_slots=100), fakes(free_slots=1)
    for w in (draining, spare):
        w.register(address)
    answer = register(address, draining.info, draining.load, AUTH, timeout=5,
                      draining="this decode worker is shutting down")
    assert answer["decode_peers"] == 1       # where its running requests could move
    outs = router.generate(prompt_token_ids=[[1, 2], [3], [4, 5, 6]],
                           sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    assert [o.token_ids for o in outs] == [[7, 7]] * 3
    assert (draining.decode_calls, spare.decode_calls) == (0, 3)
    assert set(router.live_workers()) == {draining.info.address, spare.info.address}
    assert [w["address"] for w in router.worker_loads()] == [spare.info.address]
    # The spare drains too: nowhere left to move to (its requests finish in place).
    answer = register(address, spare.info, spare.load, AUTH, timeout=5, draining="switching")
    assert answer["decode_peers"] == 0
    draining.register(address)                   # a beat without it: chosen again
    router.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=2,
                                                                             **GREEDY))
    assert draining.decode_calls == 1


def test_a_prefill_worker_whose_heartbeat_says_draining_gets_no_new_request(router, fakes):
    """Draining holds for both roles: a prefill worker saying so is chosen for no new
    Prefill (the other one gets them), stays live, and is chosen again once a beat no
    longer says it."""
    router, address = router
    decoder = fakes()
    draining, spare = fakes(role="prefill"), fakes(role="prefill")
    for w in (decoder, draining, spare):
        w.register(address)
    answer = register(address, draining.info, {**draining.load, "queue": 0}, AUTH, timeout=5,
                      draining="this prefill worker is shutting down")
    assert "decode_peers" not in answer          # a decode worker's question only
    spare.load["queue"] = 5                      # the draining one looks cheaper
    spare.register(address)
    outs = router.generate(prompt_token_ids=[[1, 2], [3], [4, 5, 6]],
                           sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    assert [o.token_ids for o in outs] == [[7, 7]] * 3
    assert (draining.prefill_calls, spare.prefill_calls) == (0, 3)
    assert draining.info.address in router.live_workers()
    assert draining.info.address not in [w["address"] for w in router.worker_loads()]
    draining.register(address)                   # a beat without it: chosen again
    router.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=2,
                                                                             **GREEDY))
    assert draining.prefill_calls == 1


def test_lease_drops_a_silent_worker_and_readmits_it(router, fakes):
    router, address = router
    worker = fakes()
    worker.heartbeat(address)
    wait_until(router.ready)
    worker.stop_heartbeat()
    wait_until(lambda: not router.ready(), timeout=5)        # lease 0.6 s
    assert router.live_workers() == {}
    worker.heartbeat(address)
    wait_until(router.ready)


def test_a_slow_prefill_on_a_live_worker_is_never_cancelled(router, fakes):
    """A Prefill call has no deadline: a worker that keeps its lease (busy with a long
    prompt, a queue or a compile) finishes it, however many leases and stall timeouts
    it outlasts, and the prompt is computed once."""
    router, address = router
    decoder, slow = fakes(), fakes(role="prefill", prefill_s=2.0)
    for w in (decoder, slow):
        w.heartbeat(address)
    wait_until(lambda: len(router.live_workers()) == 2)
    out = router.generate(prompt_token_ids=[[1, 2, 3]],
                          sampling_params=SamplingParams(max_tokens=2, **GREEDY))[0]
    assert out.token_ids == [7, 7]
    assert (slow.prefill_calls, decoder.reprefill_calls) == (1, 0)
    counts = router.counters.snapshot()
    assert counts["prefill_failovers"] == counts["workers_dropped"] == 0


def test_a_prefill_worker_that_loses_its_lease_fails_its_request_over(router, fakes):
    """What ends a Prefill call is its worker's liveness: a prefill worker that stops
    heartbeating mid-call is dropped when its lease lapses, the call is cancelled and
    the request fails over (here to the decode worker's own prefill)."""
    router, address = router
    decoder, stuck = fakes(), fakes(role="prefill", prefill_s=60.0)
    for w in (decoder, stuck):
        w.heartbeat(address)
    wait_until(lambda: len(router.live_workers()) == 2)
    threading.Timer(0.3, stuck.stop_heartbeat).start()     # mid-call
    out = router.generate(prompt_token_ids=[[1, 2, 3]],
                          sampling_params=SamplingParams(max_tokens=2, **GREEDY))[0]
    assert out.token_ids == [7, 7]
    assert (stuck.prefill_calls, decoder.reprefill_calls) == (1, 1)
    counts = router.counters.snapshot()
    assert counts["prefill_failovers"] == counts["workers_dropped"] == 1


def test_stalled_decode_stream_fails_over_within_the_stall_deadline(router, fakes):
    """A decode worker that keeps heartbeating but whose stream says nothing (not even
    its keepalive) loses the request to another worker after stall_timeout_s."""
    router, address = router
    frozen, good = fakes(frozen=True, free_slots=100), fakes(free_slots=1)
    frozen.heartbeat(address)
    good.heartbeat(address)
    wait_until(lambda: len(router.live_workers()) == 2)
    start = time.monotonic()
    out = router.generate(prompt_token_ids=[[1, 2, 3]],
                          sampling_params=SamplingParams(max_tokens=4, **GREEDY))[0]
    assert time.monotonic() - start < 5                  # stall deadline 0.6 s
    assert (frozen.decode_calls, good.decode_calls) == (1, 1)
    assert out.token_ids == [7] * 4 and router.counters.snapshot()["decode_failovers"] == 1


def test_stalled_last_decode_worker_aborts_with_a_reason(router, fakes):
    router, address = router
    frozen = fakes(frozen=True)
    frozen.heartbeat(address)
    wait_until(router.ready)
    start = time.monotonic()
    out = router.generate(prompt_token_ids=[[1, 2, 3]],
                          sampling_params=SamplingParams(max_tokens=4, **GREEDY))[0]
    assert time.monotonic() - start < 5
    assert out.finish_reason == "abort" and "no decode worker" in out.abort_reason


class ScriptedWorker(FakeWorker):
    """A decode worker whose stream sends `event` for each token to generate."""

    def __init__(self, event: dict, **kwargs):
        super().__init__(**kwargs)
        self.event = event

    def Decode(self, msg, context):
        self.decode_calls += 1
        yield {"registered": True}
        r = msg["request"]
        for _ in range(r["params"]["max_tokens"] - len(r["output_ids"])):
            yield {"finish": None, "abort_reason": None, **self.event}


@pytest.mark.parametrize("forged,params", [
    ({"token_ids": [7], "logprobs": [[float("inf"), []]]}, dict(logprobs=1)),
    ({"token_ids": [7], "logprobs": [[-0.5, [["7", -0.5]]]]}, dict(logprobs=1)),
    ({"token_ids": [7]}, dict(logprobs=1)),
    ({"token_ids": [10**9]}, {}), ({"token_ids": "7"}, {})])
def test_malformed_decode_event_fails_the_request_over_to_another_worker(router, forged,
                                                                          params):
    router, address = router
    bad = ScriptedWorker(forged, free_slots=8)               # the router's first choice
    good = ScriptedWorker({"token_ids": [7], "logprobs": [[-0.5, [[7, -0.5]]]]}, free_slots=1)
    try:
        for w in (bad, good):
            w.heartbeat(address)
        wait_until(lambda: len(router.live_workers()) == 2)
        out = router.generate(prompt_token_ids=[[1, 2, 3]],
                              sampling_params=SamplingParams(max_tokens=3, **GREEDY, **params))[0]
    finally:
        bad.close()
        good.close()
    assert out.token_ids == [7] * 3 and out.finish_reason == "length"
    assert (bad.decode_calls, good.decode_calls) == (1, 1)
    assert router.counters.snapshot()["decode_failovers"] == 1
    if params:
        assert out.logprobs == [(-0.5, ((7, -0.5),))] * 3


def test_lease_expiry_cancels_streams_on_the_dropped_worker(fakes):
    """A worker frozen whole (no heartbeat, no stream): its lease runs out first and
    its request fails over, as for a SIGKILLed worker."""
    router, address = _router(stall_timeout_s=60)
    try:
        frozen, good = fakes(frozen=True, free_slots=100), fakes(free_slots=1)
        frozen.register(address)                         # one registration, then silence
        good.heartbeat(address)
        start = time.monotonic()
        out = router.generate(prompt_token_ids=[[4, 5]],
                              sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0]
        assert time.monotonic() - start < 5
        assert out.token_ids == [7] * 3 and frozen.decode_calls == 1
        assert frozen.info.address not in router.live_workers()
    finally:
        router.shutdown()


def test_stats_fan_out_is_parallel_and_bounded(router, fakes):
    router, address = router
    for _ in range(4):
        w = fakes(hang_info=True)
        w.heartbeat(address)
    answering = fakes()
    answering.heartbeat(address)
    wait_until(lambda: len(router.live_workers()) == 5)
    start = time.monotonic()
    stats = router.stats()
    assert time.monotonic() - start < 3                  # 4 x 1 s if asked one by one
    assert [w["address"] for w in stats["workers"]["decode"]] == [answering.info.address]


def test_static_workers_are_probed_and_checked_before_use(fakes):
    good, small = fakes(), fakes(max_model_len=64, max_prompt_len=63)
    router = Router(default_model_dir(), RouterConfig(max_model_len=512, heartbeat_s=0.1),
                    decode=(good.info.address, small.info.address))
    try:
        wait_until(router.ready)
        time.sleep(0.3)                                  # a few more probes
        assert router.live_workers() == {good.info.address: "decode"}
    finally:
        router.shutdown()


def test_mtls_register_and_role_client(tmp_path, fakes):
    ca = make_ca(str(tmp_path))
    pem = lambda name: issue(str(tmp_path), ca, name)
    auth = lambda p: InternalAuth.from_options(tls_cert=p.cert, tls_key=p.key, tls_ca=p.ca)
    router_auth, worker_auth = auth(pem("router")), auth(pem("worker"))
    router, address = _router(auth=router_auth)
    try:
        worker = fakes(auth=worker_auth)
        worker.register(address, auth=worker_auth)
        assert router.ready()
        rogue_pem = issue(str(tmp_path), make_ca(str(tmp_path), "other-ca"), "rogue")
        rogue = InternalAuth.from_options(tls_cert=rogue_pem.cert, tls_key=rogue_pem.key,
                                          tls_ca=ca[2])
        for stranger in (NO_AUTH, rogue):
            code, _ = _code(lambda: fakes().register(address, auth=stranger))
            assert code == grpc.StatusCode.UNAVAILABLE   # the handshake fails
            code, _ = _code(lambda: RoleClient(worker.info.address, stranger).info(timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE
        assert len(router.live_workers()) == 1
        assert RoleClient(worker.info.address, router_auth).info(timeout=5)["role"] == "decode"
        out = router.generate(prompt_token_ids=[[1]],
                              sampling_params=SamplingParams(max_tokens=2, **GREEDY))[0]
        assert out.token_ids == [7, 7]
    finally:
        router.shutdown()


# ---- a real engine behind a RoleServer (worker side) --------------------------------------


@pytest.fixture(scope="module")
def decode_worker(tiny_hf_model):
    llm, server = start_worker(tiny_hf_model[0])
    yield llm, server, RoleClient(server.address, AUTH)
    server.stop(0)
    llm.shutdown()


def _wire(request_id="w-1", prompt=(5, 6, 7), max_tokens=4, **changes):
    wire = {"request_id": request_id, "prompt_ids": list(prompt), "output_ids": [], "seed": 1,
            "stop_ids": [], "params": {"max_tokens": max_tokens, "temperature": 0.0, "top_k": 0,
                                       "top_p": 1.0, "seed": None, "stop_token_ids": [],
                                       "ignore_eos": True}}
    return {**wire, **changes}


def _decode_all(client, wire):
    tokens, finish = [], None
    for event in client.decode(wire, local=True):
        tokens += event.get("token_ids", [])
        finish = event.get("finish") or finish
    return tokens, finish


FORGED = [
    (_wire(prompt=[3] * 300), "max_prompt_len"),             # finding 4
    (_wire(prompt=[3] * 100, max_tokens=100), "max_model_len"),
    (_wire(prompt=[3, 10**6]), "vocabulary"),
    (_wire(prompt=[]), "empty"),
    (_wire(prompt="abc"), "prompt"),
    (_wire(request_id="x\x00\x1b[2J"), "request_id"),
    (_wire(request_id="r" * 10_000), "request_id"),
    (_wire(output_ids=[1] * 4), "output_ids"),
    (_wire(stop_ids=[10**9]), "stop_ids"),
    (_wire(seed="nope"), ""),
    (_wire(seed=-1), "seed"),
    (_wire(params=None), "params"),
    (_wire(params={"max_tokens": -3, "stop_token_ids": []}), "max_tokens"),
    (_wire(params={"evil": 1, "stop_token_ids": []}), ""),
    (_wire(stop_ids=[[1]]), ""),
    (_wire(params={**_wire()["params"], "logprobs": 21}), "logprobs"),
    (_wire(params={**_wire()["params"], "stop": [""]}), "stop"),
    (_wire(params={**_wire()["params"], "n": 2**40}), "n "),
    ({"request_id": "w-2"}, ""),
    ([1, 2, 3], ""),
    ("junk", ""),
    (None, "")]


def test_forged_decode_requests_are_invalid_argument_and_engine_keeps_serving(decode_worker):
    llm, server, client = decode_worker
    before = _decode_all(client, _wire(request_id="before-forgery", max_tokens=5))
    for wire, word in FORGED:
        code, details = _code(lambda: list(client.decode(wire, local=True)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (wire, details)
        assert word in details, (word, details)
        code, _ = _code(lambda: list(client.decode(wire, local=False)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    with server.auth.channel(server.address) as channel:     # not even msgpack
        call = channel.unary_stream(f"/{ROLE_SERVICE}/Decode")
        assert _code(lambda: list(call(b"\xc1garbage", timeout=5)))[0] == \
            grpc.StatusCode.INVALID_ARGUMENT
    assert llm.engine.error is None
    after = _decode_all(client, _wire(request_id="after-forgery", max_tokens=5))
    assert after == before and len(after[0]) == 5 and after[1] == "length"


def test_forged_prefill_requests_are_invalid_argument(tiny_hf_model):
    llm, server = start_worker(tiny_hf_model[0], mesh="prefill=1")
    try:
        client = RoleClient(server.address, AUTH)
        for wire, word in FORGED[:6]:
            code, details = _code(lambda: client.prefill(wire, "127.0.0.1:1", timeout=10).result())
            assert code == grpc.StatusCode.INVALID_ARGUMENT and word in details
        for destination in (None, 5, "", "h" * 1000):
            code, _ = _code(lambda: client.prefill(_wire(), destination, timeout=10).result())
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert llm.engine.error is None and llm.engine.is_idle()
    finally:
        server.stop(0)
        llm.shutdown()


def test_decode_stream_carries_each_tokens_logprobs(decode_worker):
    llm, server, client = decode_worker
    wire = _wire(request_id="with-logprobs", max_tokens=4, logprobs=[],
                 params={**_wire()["params"], "logprobs": 2})
    events = [e for e in client.decode(wire, local=True) if e.get("token_ids")]
    tokens = [t for e in events for t in e["token_ids"]]
    logprobs = [lp for e in events for lp in e["logprobs"]]
    assert len(tokens) == len(logprobs) == 4
    for token, (sampled, top) in zip(tokens, logprobs):
        assert len(top) == 2 and top[0] == [token, sampled]     # greedy: the best one
        assert 0 >= top[0][1] >= top[1][1]


def test_decode_streams_hold_no_worker_thread_and_a_cancel_frees_their_slots(decode_worker):
    """Many Decode streams open at once on a worker with 2 slots (the rest queued):
    none holds a worker thread, and cancelling them (the router gave up) aborts every
    request, so the engine goes idle with all pages free."""
    from tests.engine_fixtures import assert_all_pages_free
    llm, server, client = decode_worker
    num_streams = 24
    threads_before = threading.active_count()
    aborted_before = llm.stats()["aborted"]
    streams = [client.decode(_wire(request_id=f"many-{i}", max_tokens=120), local=True)
               for i in range(num_streams)]
    assert [next(s) for s in streams] == [{"registered": True}] * num_streams
    assert threading.active_count() < threads_before + num_streams // 2
    for s in streams:
        s.cancel()
    assert_all_pages_free(llm)          # idle: every request ended
    # Only those holding the 2 slots may have run to their end before the cancel.
    assert llm.stats()["aborted"] - aborted_before >= num_streams - 2
    after = _decode_all(client, _wire(request_id="after-cancels", max_tokens=5))
    assert len(after[0]) == 5 and after[1] == "length"


def test_stranger_cannot_abort_info_or_decode(decode_worker):
    llm, server, client = decode_worker
    stranger = RoleClient(server.address, NO_AUTH)
    wrong = RoleClient(server.address, InternalAuth(token="guessed-token-0123456789"))
    stream = client.decode(_wire(request_id="victim", max_tokens=40), local=True)
    assert next(stream) == {"registered": True}
    for who in (stranger, wrong):
        assert _code(lambda: who.abort("victim", "gotcha", timeout=5))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: who.info(timeout=5))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: list(who.decode(_wire(request_id="s"), local=True)))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: who.reprefill("victim", timeout=5))[0] == \
            grpc.StatusCode.UNAUTHENTICATED
    events = list(stream)
    assert events[-1]["finish"] == "length" and events[-1]["abort_reason"] is None
    assert sum(len(e.get("token_ids", [])) for e in events) == 40
    with pytest.raises(grpc.RpcError):                  # bad abort fields from a peer
        client.abort("victim", "\x1b[2J" * 100, timeout=5)


@pytest.mark.slow
def test_cluster_token_router_to_real_worker_in_process(decode_worker, tiny_hf_model):
    """Router -> registered decode worker (prefilling locally: no prefill worker), all
    on the token-authenticated plane; greedy output equals Hugging Face's."""
    from tests.hf_fixtures import hf_greedy
    llm, server, _ = decode_worker
    path, hf = tiny_hf_model
    # The default lease (5 s): the worker's first compiles must not drop it.
    router = Router(path, RouterConfig(max_model_len=MAX_MODEL_LEN, heartbeat_s=1.0), auth=AUTH)
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        server.register_with(address, heartbeat_s=0.2)
        wait_until(router.ready, timeout=20)
        prompts = [[5, 6, 7], [9] * 20, [11, 12]]
        outs = router.generate(prompt_token_ids=prompts,
                               sampling_params=SamplingParams(max_tokens=6, **GREEDY))
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
        assert router.counters.snapshot()["decode_prefills"] == 3
    finally:
        router.shutdown()


def test_a_real_worker_of_either_role_says_it_drains_in_every_heartbeat(tiny_hf_model):
    """A prefill and a decode worker (real engines) that start draining tell the router
    at once and in each heartbeat after; the router chooses neither for anything new
    (a draining prefill worker: the decode worker prefills on its own mesh; a draining
    last decode worker: the request fails with the reason), and both again once they
    stop saying it."""
    path = tiny_hf_model[0]
    made = [start_worker(path, mesh="prefill=1"), start_worker(path, mesh="decode=1")]
    router = Router(path, RouterConfig(max_model_len=MAX_MODEL_LEN, heartbeat_s=1.0,
                                       lease_s=30.0), auth=AUTH)
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        for _, server in made:
            server.register_with(address, heartbeat_s=0.1)
        wait_until(lambda: len(router.live_workers()) == 2, timeout=30)
        choosable = lambda: {w["role"] for w in router.worker_loads()}   # noqa: E731
        assert choosable() == {"prefill", "decode"}
        (prefill_llm, prefill), (decode_llm, decode) = made
        prefill.announce_draining("this prefill worker is shutting down")
        assert choosable() == {"decode"}                 # told at once, out of turn
        time.sleep(0.5)                                  # ... and in the beats after
        assert choosable() == {"decode"}
        assert router.workers.get(prefill.address).says_draining == \
            "this prefill worker is shutting down"
        out = router.generate(prompt_token_ids=[[5, 6, 7]],
                              sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0]
        assert len(out.token_ids) == 3
        counts = router.counters.snapshot()
        assert counts["decode_prefills"] == 1 and counts["prefill_failovers"] == 0
        decode.announce_draining("this decode worker is shutting down")
        time.sleep(0.5)
        assert choosable() == set() and len(router.live_workers()) == 2
        out = router.generate(prompt_token_ids=[[5, 6, 7]],
                              sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0]
        assert out.finish_reason == "abort" and "no decode worker" in out.abort_reason
        for _, server in made:
            server.service.stopping = None
        wait_until(lambda: choosable() == {"prefill", "decode"})
    finally:
        router.shutdown()
        for llm, server in made:
            server.stop(0)
            llm.shutdown()


def test_mismatch_router_larger_than_worker_is_refused_and_worker_stops(decode_worker,
                                                                        tiny_hf_model):
    llm, server, _ = decode_worker
    router = Router(tiny_hf_model[0], RouterConfig(max_model_len=4 * MAX_MODEL_LEN), auth=AUTH)
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        refused = []
        thread = server.register_with(address, heartbeat_s=0.2, on_refused=refused.append)
        thread.join(20)
        assert not thread.is_alive()                     # stopped retrying
        assert refused and "max_model_len: decode worker" in refused[0]
        assert f"smaller than the router's {4 * MAX_MODEL_LEN}" in refused[0]
        assert not router.ready()
    finally:
        router.shutdown()


def test_dead_engine_health_not_serving_and_unavailable(tiny_hf_model):
    llm, server = start_worker(tiny_hf_model[0])
    try:
        client = RoleClient(server.address, AUTH)
        assert client.info(timeout=5)["role"] == "decode"

        def boom(**_):
            raise RuntimeError("injected engine failure")
        llm.engine.decode_loop.iterate = boom
        wait_until(lambda: llm.engine.error is not None)
        with NO_AUTH.channel(server.address) as channel:     # health needs no token
            check = lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5).status
            wait_until(lambda: check() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        assert _code(lambda: client.info(timeout=5))[0] == grpc.StatusCode.UNAVAILABLE
        code, details = _code(lambda: list(client.decode(_wire(), local=True)))
        assert code == grpc.StatusCode.UNAVAILABLE and "injected" in details
    finally:
        server.stop(0)
        llm.shutdown()


def test_worker_threads_stay_bounded_and_health_answers_with_many_streams_open():
    """A Decode stream in flight holds no thread on a worker: with many streams open
    at once (each waiting, as a stream between tokens does), the worker's own threads
    are its event loop and at most its small pool, and a health probe still answers.
    Stopping with no grace cuts the streams off and joins the threads."""
    import asyncio
    import types
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from jaxpd.serving.role_server import RPC_THREADS, RoleServer

    num_streams = 64
    release = threading.Event()

    async def hold(_request, context):
        yield b"started"
        while not release.is_set():
            await asyncio.sleep(0.05)

    service = types.SimpleNamespace(
        engine=types.SimpleNamespace(error=None), error=None,
        handlers=lambda: grpc.method_handlers_generic_handler(
            "t.Hold", {"Hold": grpc.unary_stream_rpc_method_handler(hold)}))
    others = set(threading.enumerate())        # other tests' workers may still run
    server = RoleServer(service, "127.0.0.1", 0)
    server.start()
    worker_threads = lambda: [t.name for t in threading.enumerate()
                              if t.name.startswith("jaxpd-worker") and t not in others]
    try:
        with grpc.insecure_channel(server.address) as channel:
            streams = [channel.unary_stream("/t.Hold/Hold")(b"", timeout=60)
                       for _ in range(num_streams)]
            assert [next(s) for s in streams] == [b"started"] * num_streams
            assert len(worker_threads()) <= 1 + RPC_THREADS, worker_threads()
            check = health_pb2_grpc.HealthStub(channel).Check
            for _ in range(5):
                assert check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING
            server.stop(0)         # no grace: every stream still open is cut off
            for s in streams:
                with pytest.raises(grpc.RpcError):
                    list(s)
    finally:
        release.set()
        server.stop(0)
    assert worker_threads() == []


# ---- model versions: fingerprints decide who pairs with whom ----------------------------

def test_prefill_and_decode_of_different_models_are_never_paired(router, fakes):
    """Identical shapes, other weights: the prefill worker of model B never sends KV to
    the decode worker of model A; A prefills on its own mesh, and health says why B's
    prefill worker is idle."""
    router, address = router
    decode_a = fakes(model=MODEL_A, token=7)
    prefill_b = fakes(role="prefill", model=MODEL_B, token=8)
    prefill_b.register(address)
    assert not router.ready()                       # a prefill-only pool cannot serve
    assert any("have no decode worker serving the same model" in p and MODEL_B[:12] in p
               for p in router.problems()), router.problems()
    decode_a.register(address)
    assert router.ready() and router.fingerprint == MODEL_A
    outs = router.generate(prompt_token_ids=[[1, 2], [3, 4, 5]],
                           sampling_params=SamplingParams(max_tokens=3, **GREEDY))
    assert [o.token_ids for o in outs] == [[7, 7, 7]] * 2
    assert prefill_b.prefill_calls == 0 and decode_a.reprefill_calls == 2
    stats = router.stats()
    assert stats["fingerprint"] == MODEL_A[:12]
    assert {v["model"] for v in stats["versions"]} == {MODEL_A[:12], MODEL_B[:12]}
    assert len(stats["problems"]) == 1


def test_matching_prefill_worker_gets_the_kv_of_its_own_model(router, fakes):
    router, address = router
    decode_a, decode_b = fakes(model=MODEL_A, token=7), fakes(model=MODEL_B, token=8)
    prefill_a = fakes(role="prefill", model=MODEL_A)
    for w in (decode_a, prefill_a, decode_b):
        w.register(address)
    # B registered last but has no prefill worker: A (both roles live) serves.
    assert router.serving_model() == MODEL_A
    outs = router.generate(prompt_token_ids=[[1, 2]] * 3,
                           sampling_params=SamplingParams(max_tokens=2, **GREEDY))
    assert [o.token_ids for o in outs] == [[7, 7]] * 3
    assert prefill_a.destinations == [decode_a.info.kv_address] * 3
    assert decode_b.decode_calls == 0 and router.problems() == []


def test_rolling_update_new_requests_go_to_the_newest_paired_version(router, fakes):
    """v1 serves; v2's decode then prefill workers join: new requests go to v2 once
    both its roles are live; a request that started on v1 finishes on v1 (never moved
    to v2) even when its v1 decode worker is lost."""
    router, address = router
    v1 = [fakes(model=MODEL_A, token=7), fakes(role="prefill", model=MODEL_A)]
    v1_spare = fakes(model=MODEL_A, token=7)
    for w in v1:
        w.heartbeat(address)
    wait_until(router.ready)
    v2 = [fakes(model=MODEL_B, token=8), fakes(role="prefill", model=MODEL_B)]
    v2[0].heartbeat(address)
    wait_until(lambda: len(router.live_workers()) == 3)
    assert router.serving_model() == MODEL_A       # v2 has no prefill worker yet
    v2[1].heartbeat(address)
    wait_until(lambda: router.serving_model() == MODEL_B)
    out = router.generate(prompt_token_ids=[[1, 2]],
                          sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.token_ids == [8, 8, 8] and v2[1].prefill_calls == 1
    # A v1 request whose decode worker is lost fails over to another v1 worker only.
    frozen = fakes(model=MODEL_A, frozen=True, free_slots=100)   # chosen first
    router2, address2 = _router()
    try:
        for w in (frozen, v1_spare):
            w.heartbeat(address2)
        v1[1].register(address2)
        wait_until(lambda: len(router2.live_workers()) == 3)
        r = router2.submit(router2.make_requests(
            prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0])
        wait_until(lambda: frozen.decode_calls == 1)
        for w in (fakes(model=MODEL_B, token=8), fakes(role="prefill", model=MODEL_B)):
            w.heartbeat(address2)
        wait_until(lambda: router2.serving_model() == MODEL_B)
        wait_until(lambda: r.is_final, timeout=15)       # the stall (0.6 s) fails it over
        assert r.output_ids == [7, 7, 7] and v1_spare.decode_calls == 1
        v1_spare.stop_heartbeat()
        frozen.stop_heartbeat()
        wait_until(lambda: MODEL_A[:12] not in {v["model"] for v in router2.versions()}, timeout=5)
        late = router2.submit(router2.make_requests(
            prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2, **GREEDY))[0])
        wait_until(lambda: late.is_final)
        assert late.output_ids == [8, 8]            # new requests: v2
    finally:
        router2.shutdown()
