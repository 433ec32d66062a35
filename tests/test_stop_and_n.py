"""Stop strings (across token boundaries, while streaming) and `n` samples per prompt:
the text path (`jaxpd.text`), the library (`LLM`), gRPC and the OpenAI HTTP API, on
the built-in default model (it has a tokenizer) served disaggregated."""
import random

import grpc
import openai
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.default_model import default_model_dir
from jaxpd.models.tokenizer import IncrementalDecoder, Tokenizer
from jaxpd.serving.http import HttpServer, OpenAIService
from jaxpd.text import TextStream, find_stop, output_text

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = "The string is"


class CharTokenizer:
    """Token i is character chr(i): every split of a text into tokens is possible."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def llm():
    """The built-in model at the library's defaults but for the sizes: warm-up and kept
    executables on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
        with LLM(mesh="prefill=1,decode=1", max_model_len=64, slots_per_shard=4) as llm:
            yield llm


def wait_free(llm) -> None:
    import time
    deadline = time.monotonic() + 30
    while llm.stats()["pages_used"] or llm.stats()["slots_active"]:
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.05)


# ---- the text path ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_stream_with_stop_strings_equals_the_cut_text_for_every_split(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c\n") for _ in range(40))
    stops = [text[i:i + rng.randint(1, 4)] for i in (rng.randrange(5, 35),)] + ["zz"]
    ids = [ord(c) for c in text]
    stream, sent, pos = TextStream(CharTokenizer(), stops), "", 0
    while pos < len(ids):                       # random chunking of the token stream
        step = rng.randint(1, 3)
        sent += stream.push(ids[pos:pos + step])
        pos += step
        if stream.stop_at is None:              # nothing past a possible stop prefix
            assert len(sent) <= len(stream.text) - (max(map(len, stops)) - 1) or \
                len(sent) == 0
    sent += stream.finish()
    cut = find_stop(text, stops)
    assert sent == text[:cut] == output_text(CharTokenizer(), ids, stops)
    assert not any(s in sent for s in stops)


def test_incremental_decoder_equals_whole_decode_on_multibyte_text(tokenizer):
    text = "Zürich – 東京 🙂 and ASCII again, naïve café"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push([t]) for t in ids]
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_with_a_real_tokenizer(tokenizer):
    text = "the cat sat on the mat, the end"
    ids = tokenizer.encode(text)[1 if tokenizer.add_bos else 0:]
    stops = ["on the m"]                          # spans several tokens
    assert output_text(tokenizer, ids, stops) == tokenizer.decode(ids)[:text.index("on the m")]


# ---- the library --------------------------------------------------------------------

def _stop_in_the_middle(llm) -> tuple[list[int], str, str]:
    """A greedy output and a stop string taken from its middle that spans tokens."""
    full = llm.generate(PROMPT, SamplingParams(max_tokens=24, **GREEDY))[0]
    text = full.text
    for start in range(4, len(text) - 6):
        stop = text[start:start + 5]
        if stop.strip() and text.index(stop) == start:
            return full.token_ids, text, stop
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.slow
def test_stop_string_ends_the_request_and_cuts_the_text(llm):
    ids, text, stop = _stop_in_the_middle(llm)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, stop=[stop, "\x00never"],
                                              **GREEDY))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
    # the request stopped at the token that completed the stop string, not later
    n = len(out.token_ids)
    assert out.token_ids == ids[:n] and n < len(ids)
    assert stop in llm.tokenizer.decode(ids[:n]) and stop not in llm.tokenizer.decode(ids[:n - 1])
    streamed = list(llm.stream(PROMPT, SamplingParams(max_tokens=24, stop=[stop], **GREEDY)))
    assert "".join(d.text for d in streamed) == out.text
    assert streamed[-1].finish_reason == "stop"
    wait_free(llm)


def test_stop_string_and_n_are_validated():
    for bad in ([""], ["x"] * 17, [5], ["x" * 257]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
    with pytest.raises(ValueError, match="n "):
        SamplingParams(n=0)


@pytest.mark.slow
def test_n_samples_are_seeded_requests_in_a_row(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    outs = llm.generate([PROMPT, "A string"], params)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert len({o.request_id for o in outs}) == 6
    for k, prompt in enumerate([PROMPT, "A string"]):
        for i in range(3):
            alone = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0,
                                                        seed=11 + i, ignore_eos=True))[0]
            assert outs[3 * k + i].token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1     # the seeds differ
    with pytest.raises(ValueError, match="n=2"):
        list(llm.stream(PROMPT, SamplingParams(n=2)))
    wait_free(llm)


# ---- gRPC ---------------------------------------------------------------------------

@pytest.mark.slow
def test_grpc_n_and_stop(llm):
    from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
    from jaxpd.serving.server import InferenceServer
    ids, text, stop = _stop_in_the_middle(llm)
    server = InferenceServer(port=0)
    server.attach(llm)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            req = jaxpd_pb2.GenerateRequest(prompt=PROMPT, max_tokens=24, temperature=0,
                                            ignore_eos=True, stop=[stop], n=2,
                                            request_id="mine")
            done = stub.Complete(req, timeout=60)
            assert [s.index for s in done.samples] == [0, 1]
            assert all(s.text == text[:text.index(stop)] and s.finish_reason == "stop"
                       for s in done.samples)
            assert done.text == done.samples[0].text and done.request_id == "mine"
            texts = {0: "", 1: ""}
            finishes = {}
            for msg in stub.Generate(req, timeout=60):
                texts[msg.index] += msg.text
                if msg.HasField("finish_reason"):
                    finishes[msg.index] = msg.finish_reason
            assert texts == {0: done.text, 1: done.text} and finishes == {0: "stop", 1: "stop"}
            for bad in (dict(n=0), dict(n=99), dict(stop=[""]), dict(min_p=2.0),
                        dict(logprobs=21), dict(presence_penalty=9.0)):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Complete(jaxpd_pb2.GenerateRequest(prompt=PROMPT, **bad), timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert next(iter(bad)) in e.value.details()
    finally:
        server.stop(0)
    wait_free(llm)


# ---- HTTP ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(llm):
    server = HttpServer(OpenAIService(), port=0)
    server.attach(llm)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                        max_retries=0, timeout=60)
    server.stop(grace_s=0)


@pytest.mark.slow
def test_openai_n_and_stop_streamed_and_not(client, llm):
    ids, text, stop = _stop_in_the_middle(llm)
    kwargs = dict(model="default_model", prompt=PROMPT, max_tokens=24, temperature=0,
                  stop=[stop], n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.text == text[:text.index(stop)] and c.finish_reason == "stop"
               for c in whole.choices)
    assert whole.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    texts, finishes = ["", ""], [None, None]
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [whole.choices[0].text] * 2 and finishes == ["stop", "stop"]
    batch = client.completions.create(model="default_model", prompt=[PROMPT, "A string"],
                                      max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text != batch.choices[2].text
    wait_free(llm)


@pytest.mark.slow
def test_openai_chat_n_streams_every_choice(client, llm):
    messages = [{"role": "user", "content": "What is a string?"}]
    whole = client.chat.completions.create(model="default_model", messages=messages, n=2,
                                           temperature=0, max_completion_tokens=6)
    contents = ["", ""]
    for chunk in client.chat.completions.create(model="default_model", messages=messages,
                                                n=2, temperature=0, max_completion_tokens=6,
                                                stream=True):
        for c in chunk.choices:
            contents[c.index] += c.delta.content or ""
    assert contents == [c.message.content for c in whole.choices]
    wait_free(llm)


@pytest.mark.slow
def test_openai_logprobs_completions_and_chat(client, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0]
    assert len(ref.logprobs) == 5 and all(len(top) == 3 for _, top in ref.logprobs)
    out = client.completions.create(model="default_model", prompt=PROMPT, max_tokens=5,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([v for v, _ in ref.logprobs], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs] == [3] * 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    chunks = list(client.completions.create(model="default_model", prompt=PROMPT,
                                            max_tokens=5, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs
                for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    chat = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "Hi"}], temperature=0,
        max_completion_tokens=4, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    wait_free(llm)


# ---- a router and a decode worker -----------------------------------------------------

@pytest.mark.slow
def test_router_relays_a_stop_string_matched_on_the_decode_worker(llm):
    """The worker (own engine, default model) ends the request on the stop string; the
    router finishes its own request with that reason and cuts the text the same way."""
    from jaxpd.serving.router import Router, RouterConfig
    from tests.support.internal_plane import AUTH, start_worker, wait_until
    ids, text, stop = _stop_in_the_middle(llm)
    worker, server = start_worker(default_model_dir(), mesh="decode=1")
    router = Router(default_model_dir(), RouterConfig(max_model_len=128, heartbeat_s=1.0),
                    auth=AUTH)
    try:
        server.register_with(f"127.0.0.1:{router.listen('127.0.0.1', 0)}", heartbeat_s=0.2)
        wait_until(router.ready, timeout=20)
        params = SamplingParams(max_tokens=24, stop=[stop], n=2, **GREEDY)
        outs = router.generate(PROMPT, params)
        assert [(o.finish_reason, o.text, o.index) for o in outs] == \
            [("stop", text[:text.index(stop)], 0), ("stop", text[:text.index(stop)], 1)]
        assert all(o.token_ids == ids[:len(o.token_ids)] for o in outs)
        wait_until(lambda: worker.stats()["pages_used"] == 0, timeout=10)
    finally:
        router.shutdown()
        server.stop(0)
        worker.shutdown()
