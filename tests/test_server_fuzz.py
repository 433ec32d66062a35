"""Property test: random and malformed GenerateRequests against a real server.

Whatever the fields (NaN, infinities, huge or negative numbers, out-of-vocabulary ids,
empty or missing prompts, client cancels mid-stream) or the bytes (random, truncated),
every call ends either normally or with INVALID_ARGUMENT / RESOURCE_EXHAUSTED -- never
UNKNOWN or INTERNAL, which would mean an unmapped exception -- the engine stays alive,
and afterwards every KV page and decode slot is free again.
"""
import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpd import LLM
from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.server import InferenceServer
from tests.engine_fixtures import assert_all_pages_free
from tests.support.server_model import SENTENCES, VOCAB, build_model

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64
EXPECTED_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

int32 = st.integers(-2**31, 2**31 - 1)
int64 = st.integers(-2**63, 2**63 - 1)
any_float = st.floats(allow_nan=True, allow_infinity=True)
words = st.lists(st.sampled_from(" ".join(SENTENCES).split() + ["unknown", "w99"]),
                 min_size=1, max_size=20)

# Well-formed values of every field...
VALID = {
    "prompt": words.map(" ".join),
    "token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    "max_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, VOCAB + 1),
    "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "request_id": st.uuids().map(str),
}
# ... and malformed ones: NaN, infinities, huge, negative, out of vocabulary, empty.
MALFORMED = {
    "prompt": st.text(max_size=30) | st.just("") | st.just(" ".join(["fox"] * 80)),
    "token_ids": st.lists(st.integers(VOCAB - 2, VOCAB + 2) | int32, max_size=MAX_MODEL_LEN + 4),
    "max_tokens": st.integers(-2, 0) | st.integers(MAX_MODEL_LEN - 8, MAX_MODEL_LEN + 1) | int64,
    "temperature": any_float,
    "top_k": int64,
    "top_p": any_float,
    "seed": int64,
    "stop_token_ids": st.lists(int32, min_size=1, max_size=3),
    "request_id": st.just(""),
}


@st.composite
def requests(draw) -> dict:
    """GenerateRequest fields: a well-formed request with 0-2 fields corrupted or dropped,
    so that about as many calls generate as are refused."""
    fields = {name: draw(strategy) for name, strategy in VALID.items()
              if name not in ("prompt", "token_ids") and draw(st.booleans())}
    which = draw(st.sampled_from(["prompt", "token_ids", "token_ids", None]))
    if which is not None:
        fields[which] = draw(VALID[which])
    for name in draw(st.lists(st.sampled_from(sorted(MALFORMED)), max_size=2, unique=True)):
        if name in ("prompt", "token_ids"):    # one input: a oneof keeps only one anyway
            fields.pop("prompt", None)
            fields.pop("token_ids", None)
        fields[name] = draw(MALFORMED[name])
    if "token_ids" in fields:
        fields["token_ids"] = jaxpd_pb2.TokenIds(ids=fields["token_ids"])
    return fields


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_model(str(tmp_path_factory.mktemp("fuzz_llama")))
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=MAX_MODEL_LEN, max_prefill_batch=2,
             slots_per_shard=4, warmup=False) as llm:
        server = InferenceServer(port=0)
        server.attach(llm)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                yield llm, jaxpd_pb2_grpc.GenerationStub(channel), channel
        finally:
            server.stop(grace_s=1)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(fields=requests(), unary=st.booleans(), cancel_after=st.one_of(st.none(), st.integers(0, 3)))
def test_any_request_gets_a_response_or_a_proper_status(served, fields, unary, cancel_after):
    llm, stub, _ = served
    msg = jaxpd_pb2.GenerateRequest(**fields)
    event(f"input={msg.WhichOneof('input')}")
    try:
        if unary:
            out = stub.Complete(msg, timeout=60)
            assert out.finish_reason in ("stop", "length")
            assert all(0 <= t < VOCAB for t in out.token_ids)
        else:
            call = stub.Generate(msg, timeout=60)
            for n, response in enumerate(call):
                assert all(0 <= t < VOCAB for t in response.token_ids)
                if n == cancel_after:
                    call.cancel()
                    break
            else:
                assert response.finish_reason in ("stop", "length")
    except grpc.RpcError as e:
        cancelled_by_us = e.code() == grpc.StatusCode.CANCELLED and cancel_after is not None
        if not cancelled_by_us:
            assert e.code() in EXPECTED_ERRORS, (e.code(), e.details(), msg)
            assert e.details()
            event(e.code().name)
    assert_all_pages_free(llm)
    assert llm.failure() is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=48) | requests().map(
           lambda f: jaxpd_pb2.GenerateRequest(**f).SerializeToString()[:-1]),
       method=st.sampled_from(["Generate", "Complete", "Tokenize"]))
def test_any_bytes_get_a_response_or_a_proper_status(served, data, method):
    """Bytes off the wire, random or a truncated request: never INTERNAL or UNKNOWN."""
    llm, _, channel = served
    make = channel.unary_stream if method == "Generate" else channel.unary_unary
    call = make(f"/jaxpd.v1.Generation/{method}", request_serializer=None,
                response_deserializer=None)
    try:
        result = call(data, timeout=60)
        if method == "Generate":
            list(result)
    except grpc.RpcError as e:
        assert e.code() in EXPECTED_ERRORS, (e.code(), e.details(), data)
        event(e.code().name)
    assert_all_pages_free(llm)
    assert llm.failure() is None
