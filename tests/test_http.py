"""The OpenAI-compatible HTTP server (`jaxpd.serving.http`) with the official `openai`
client, on the built-in default model (it has a tokenizer and a chat template) served
disaggregated (prefill=1,decode=1); a fake front end makes overload, shutdown and
disconnects deterministic."""
import http.client
import json
import threading
import time
import types

import openai
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.errors import QueueFull
from jaxpd.frontend import Frontend
from jaxpd.request import Request, State
from jaxpd.serving.http import HttpServer, OpenAIService

MODEL = "default_model"
GREEDY = dict(temperature=0, max_tokens=8)
CHAT = [{"role": "user", "content": "What is a string?"}]


@pytest.fixture(scope="module")
def llm():
    with LLM(mesh="prefill=1,decode=1", max_model_len=64, slots_per_shard=4, warmup=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    server = HttpServer(OpenAIService(), port=0)
    server.attach(llm)
    yield server
    server.stop(grace_s=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                         max_retries=0, timeout=60)


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def wait_all_free(llm, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.stats()
        if stats["pages_used"] == 0 and stats["slots_active"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# ---- the real model ---------------------------------------------------------------

def test_models_list_names_the_served_model(client, llm):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "jaxpd"
    assert model.model_extra["max_model_len"] == llm.config.max_model_len


def test_completions_match_llm_generate_streamed_or_not(client, llm):
    ref = llm.generate("The cat", SamplingParams(**GREEDY))[0]
    out = client.completions.create(model=MODEL, prompt="The cat", **GREEDY,
                                    extra_body={"return_token_ids": True})
    (choice,) = out.choices
    assert choice.text == ref.text
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (len(ref.prompt_token_ids), len(ref.token_ids),
         len(ref.prompt_token_ids) + len(ref.token_ids))
    # the same prompt as token ids, streamed, with the usage chunk at the end
    chunks = list(client.completions.create(
        model=MODEL, prompt=ref.prompt_token_ids, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, llm):
    """vLLM's extension, sent by benchmark clients (guidellm, aiperf): with
    include_usage, each chunk's usage counts the tokens generated until then."""
    ref = llm.generate("The cat", SamplingParams(**GREEDY, ignore_eos=True))[0]
    chunks = list(client.completions.create(
        model=MODEL, prompt="The cat", stream=True, **GREEDY,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(ref.prompt_token_ids) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == len(ref.token_ids) == 8
    assert counts[0] >= 1 and all(c.usage.total_tokens == c.usage.prompt_tokens +
                                  c.usage.completion_tokens for c in chunks)
    # Without include_usage it asks for nothing, as in vLLM; an unknown option is a 400.
    plain = list(client.completions.create(
        model=MODEL, prompt="The cat", stream=True, **GREEDY,
        stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL, prompt="The cat", stream=True, **GREEDY,
                                  stream_options={"include_usage": True, "every_chunk": True})


def test_chat_stream_assembles_the_non_streamed_answer(client, llm):
    ref = llm.chat(CHAT, SamplingParams(**GREEDY))[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                            temperature=0, max_completion_tokens=8)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_vllm_extra_fields_are_applied(client, llm):
    ref = llm.generate("The cat", SamplingParams(max_tokens=8, temperature=0.7, top_k=5,
                                                 seed=3, ignore_eos=True))[0]
    out = client.completions.create(
        model=MODEL, prompt="The cat", max_tokens=8, temperature=0.7, seed=3, user="someone",
        extra_body={"top_k": 5, "ignore_eos": True, "min_p": 0.0, "repetition_penalty": 1.0,
                    "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"top_k": "many"}), "top_k"),
    (dict(extra_body={"stop_token_ids": [10**9]}), "stop_token_ids"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(n=0), "n"),
    (dict(n=17), "n"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(echo=True), "echo"),
])
def test_bad_or_unsupported_fields_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="The cat", **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and param in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(n=0), "n"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": 5}]), "messages"),
    (dict(max_completion_tokens=1000), "max_completion_tokens"),
])
def test_chat_bad_fields_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **kwargs})
    assert e.value.body["param"] == param


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_the_full_model_path_is_accepted(client, llm):
    out = client.completions.create(model=llm.model_path, prompt="The cat", max_tokens=1,
                                    temperature=0)
    assert out.model == MODEL


def test_bad_json_and_huge_bodies_are_refused(server):
    status, _, body = request(server.port, "POST", "/v1/completions", b"{not json",
                              {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "a" * (server.service.max_body_bytes + 1)})
    status, _, body = request(server.port, "POST", "/v1/completions", huge.encode())
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_closing_a_stream_aborts_it_and_frees_its_pages_within_one_decode_step(
        client, llm, monkeypatch):
    """The client's disconnect aborts its request at once, and the decode loop frees
    its slot and pages before its next step: at most the step already being prepared
    when the abort landed runs after it (the only request here, so no other steps)."""
    requests, steps_at_abort = llm.engine.requests, []
    abort = requests.abort

    def abort_and_count(request_id, reason):
        aborted = abort(request_id, reason)
        if aborted:
            steps_at_abort.append(llm.stats()["decode_steps"])
        return aborted
    monkeypatch.setattr(requests, "abort", abort_and_count)
    stream = client.completions.create(model=MODEL, prompt="The cat", stream=True,
                                       max_tokens=60, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):   # tokens after the first come from the decode mesh: it holds pages
        next(chunks)
    stream.close()
    wait_for(lambda: steps_at_abort, timeout_s=30)
    stats = wait_all_free(llm)
    assert stats["decode_steps"] <= steps_at_abort[0] + 1, (steps_at_abort, stats)


def test_a_reader_that_stops_reading_is_cut_off_and_its_pages_freed(llm):
    """The engine never waits for a stream's reader: past the sink's bound the request
    aborts with the reason, and its slot and pages are freed."""
    from jaxpd.output_sink import SLOW_READER, EventQueue
    r = llm.make_request("The cat", sampling_params=SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True))
    r.events = EventQueue(max_buffered=4)
    llm.submit(r)              # ... and nobody reads its events
    wait_for(lambda: r.is_final, timeout_s=60)
    # the token whose event went past the bound is the last one taken
    assert r.abort_reason == SLOW_READER and len(r.output_ids) == 5
    wait_all_free(llm)


def test_health_and_metrics(server, llm):
    status, _, body = request(server.port, "GET", "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["role"] == "single"
    assert health["mesh"] == str(llm.config.mesh)
    assert health["fingerprint"] == llm.fingerprint[:12] and len(llm.fingerprint) == 64
    stats = llm.stats()
    assert health["slots_total"] == stats["slots_total"] > 0
    assert health["pages_total"] == stats["pages_total"] > 0
    assert {"queue_waiting", "slots_active", "pages_used"} <= health.keys()
    status, headers, body = request(server.port, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert "jaxpd_ttft_seconds_count" in text and "jaxpd_pages_total" in text


# ---- tools: rendered through the template, refused when asked for what cannot be ---

# The default model's template taught tools: each tool's name and description in the
# system turn, an assistant's calls and the tool's answers.
TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}: "
    "{{ t.function.description }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'tool' %}Tool {{ message['tool_call_id'] }}: "
    "{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant:"
    "{% for c in message['tool_calls'] or [] %} call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{{ message['content'] or '' }}"
    "{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_TURN = [{"role": "user", "content": "Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]


@pytest.fixture
def tools_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", TOOLS_TEMPLATE)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_tools_and_tool_turns_are_rendered_by_the_chat_template(client, llm, tools_template,
                                                                 tool_choice):
    out = client.chat.completions.create(model=MODEL, messages=TOOL_TURN, tools=[WEATHER],
                                         tool_choice=tool_choice, parallel_tool_calls=True,
                                         **GREEDY, extra_body={"return_token_ids": True})
    prompt = llm.chat_prompt(TOOL_TURN, [WEATHER])
    assert prompt.startswith("Tools: get_weather: Weather\n")
    assert 'Assistant: call get_weather {"city": "Oslo"}' in prompt   # arguments as an object
    assert "Tool call_1: sun\n" in prompt
    (choice,) = out.choices
    assert choice.model_extra["prompt_token_ids"] == llm.tokenizer.encode(prompt)
    # the tiny model writes no call: its text is the content, as without tools
    ref = llm.generate(prompt, SamplingParams(**GREEDY))[0]
    assert choice.message.content == ref.text and not choice.message.tool_calls
    assert choice.finish_reason == ref.finish_reason


def test_chat_template_kwargs_reach_the_template(client, llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template",
                        "{% if shout %}LOUD {% endif %}" + TOOLS_TEMPLATE)
    for kwargs, head in (({"shout": True}, "LOUD User:"), ({}, "User:")):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                             extra_body={"chat_template_kwargs": kwargs,
                                                         "return_token_ids": True})
        prompt = llm.chat_prompt(CHAT, template_kwargs=kwargs)
        assert prompt.startswith(head)
        assert out.choices[0].model_extra["prompt_token_ids"] == llm.tokenizer.encode(prompt)


def _tool(**function):
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize("kwargs, param, says", [
    (dict(tools=_tool(description="no name")), "tools.0.function.name", "required"),
    (dict(tools=_tool(name="f", parameters="a string")), "tools.0.function.parameters",
     "dictionary"),
    (dict(tools=_tool(name="bad name!")), "tools.0.function.name", "pattern"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type", "function"),
    (dict(tools=_tool(name="f") + _tool(name="f")), "tools", "twice"),
    (dict(tools=_tool(name="f"), tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice", "'g', which is not in tools"),
    (dict(tools=_tool(name="f"), tool_choice="sometimes"), "tool_choice", "must be"),
    (dict(tools=_tool(name="f"), extra_body={"tool_call_parser": "qwen"}), "tool_call_parser",
     "unknown parser 'qwen'"),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs",
     "cannot be set"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]),
     "messages", "not valid JSON"),
])
def test_bad_tool_fields_are_400_naming_the_field(client, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                          **kwargs})
    assert e.value.body["param"] == param, e.value.body
    assert says in e.value.body["message"]


@pytest.mark.parametrize("tools, tool_choice, param", [
    (_tool(name="f"), "required", "tool_choice"),
    (_tool(name="f"), {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    (_tool(name="f") + _tool(name="g", strict=True), "auto", "tools.1.function.strict"),
])
def test_what_needs_constrained_decoding_is_refused_clearly(client, tools, tool_choice, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       tools=tools, tool_choice=tool_choice)
    assert e.value.body["param"] == param
    assert e.value.body["code"] == "unsupported_parameter"
    assert "not support" in e.value.body["message"]


# ---- a fake front end: overload, loading, shutdown, disconnects --------------------

class FakeFrontend(Frontend):
    """Requests that produce what the test puts in their events; `full` refuses."""

    def __init__(self):
        self.config = types.SimpleNamespace(max_prompt_len=16, max_model_len=32, mesh="fake=1")
        self.model_config = types.SimpleNamespace(vocab_size=100, eos_token_ids=(2,))
        self.model_path, self.tokenizer = "/models/fake", None
        self.full = False
        self.submitted: list[Request] = []
        self._next = 0

    def new_request_id(self):
        self._next += 1
        return f"fake-{self._next}"

    def submit(self, request):
        if self.full:
            raise QueueFull("the queue is full (max_queued=1)")
        self.submitted.append(request)
        return request

    def abort(self, request_id, reason="cancelled"):
        return any(r.abort(reason) for r in self.submitted if r.request_id == request_id)

    def stats(self):
        return {"mesh": "fake=1", "slots_total": 2, "pages_total": 8, "queue_waiting": 0,
                "slots_active": 0, "pages_used": 0}


@pytest.fixture
def fake():
    fe = FakeFrontend()
    server = HttpServer(OpenAIService(model_names=("fake",)), port=0)
    yield fe, server, openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                    api_key="x", max_retries=0, timeout=30)
    server.stop(grace_s=0)


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_503_until_attached_then_429_with_retry_after_when_the_queue_is_full(fake):
    fe, server, client = fake
    status, _, body = request(server.port, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "starting"
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="fake", prompt=[5, 6], max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "service_unavailable"
    server.attach(fe)
    fe.full = True
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="fake", prompt=[5, 6], max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert "queue is full" in e.value.body["message"]
    status, _, body = request(server.port, "GET", "/metrics")
    assert 'jaxpd_rejections_total{reason="queue_full"} 1.0' in body.decode()
    # a prompt string on a model without a tokenizer: 400 naming the prompt
    fe.full = False
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake", prompt="text", max_tokens=2)
    assert e.value.body["param"] == "prompt"


def test_a_client_gone_mid_stream_aborts_its_request(fake):
    fe, server, client = fake
    server.attach(fe)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "fake", "prompt": [5, 6], "max_tokens": 10, "stream": True,
         "return_token_ids": True}))
    wait_for(lambda: fe.submitted)
    (r,) = fe.submitted
    r.events.put(([7], None))
    resp = conn.getresponse()
    assert json.loads(resp.readline()[len(b"data: "):])["choices"][0]["token_ids"] == [7]
    conn.sock.close()   # the client goes away while the request waits for its next token
    conn.close()
    wait_for(lambda: r.is_final)
    assert r.abort_reason == "client disconnected"
    wait_for(lambda: server.service.stats()["requests_in_flight"] == 0)


def test_stop_drains_then_aborts_streams_with_shutdown(fake):
    fe, server, client = fake
    server.attach(fe)
    stream = client.completions.create(model="fake", prompt=[5, 6], max_tokens=10, stream=True,
                                       extra_body={"return_token_ids": True})
    wait_for(lambda: fe.submitted)
    (r,) = fe.submitted
    r.events.put(([7], None))
    chunks = iter(stream)
    assert next(chunks).choices[0].model_extra["token_ids"] == [7]
    stopper = threading.Thread(target=server.stop, kwargs={"grace_s": 1.0})
    stopper.start()
    wait_for(lambda: server.service.draining)
    status, _, body = request(server.port, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "draining"
    with pytest.raises(openai.APIError, match="shutting down|shutdown"):
        list(chunks)   # the stream's last event is the error
    stopper.join(30)
    assert r.abort_reason == "shutdown"


# ---- tool calls and reasoning parsed from a model's output, through the server ------

class CharTokenizer:
    """One token per character (its code point): the fake's events spell any text."""
    bos_token_id = None

    def __init__(self, chat_template: str):
        self.chat_template = chat_template

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def id_to_token(self, token_id):
        return None if token_id is None else chr(token_id)


# Qwen3's shape: the template speaks of <tool_call> (hermes) and <think> (reasoning).
QWEN3_TEMPLATE = ("{% if tools %}# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
                  "Answer with <tool_call>{...}</tool_call>.\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{{ '<|im_start|>assistant\\n<think>\\n' }}")
QWEN3_OUTPUT = ("The user wants Oslo's weather.\n</think>\n\nLet me look.\n"
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n'
                "</tool_call>")


@pytest.fixture
def qwen3_fake(fake):
    fe, server, client = fake
    fe.tokenizer = CharTokenizer(QWEN3_TEMPLATE)
    fe.config = types.SimpleNamespace(max_prompt_len=2048, max_model_len=4096, mesh="fake=1")
    fe.model_config = types.SimpleNamespace(vocab_size=1 << 16, eos_token_ids=(2,))
    server.attach(fe)
    return fe, client


def _answer(fe, n_requests: int, text: str, pieces: int):
    """The next request the server submits writes `text` in `pieces` events."""
    wait_for(lambda: len(fe.submitted) == n_requests)
    r = fe.submitted[-1]
    ids = [ord(c) for c in text]
    step = -(-len(ids) // pieces)
    for i in range(0, len(ids), step):
        r.events.put((ids[i:i + step], None))
    r.output_ids = ids
    r.finish_reason = "stop"
    assert r.transition(State.FINISHED)
    r.events.put(([], "stop"))


def test_tool_calls_and_reasoning_are_parsed_whole_and_streamed(qwen3_fake):
    fe, client = qwen3_fake
    ask = dict(model="fake", messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER], max_tokens=400)
    answer = threading.Thread(target=_answer, args=(fe, 1, QWEN3_OUTPUT, 1))
    answer.start()
    whole = client.chat.completions.create(**ask)
    answer.join()
    prompt = "".join(map(chr, fe.submitted[0].prompt_ids))
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")   # the output starts thinking
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.model_extra["reasoning_content"] == "The user wants Oslo's weather.\n"
    calls = [(c.type, c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert calls == [("function", "get_weather", {"city": "Oslo"}),
                     ("function", "get_weather", {"city": "Bergen"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2

    # streamed a few characters an event: the deltas add up to the whole answer
    answer = threading.Thread(target=_answer, args=(fe, 2, QWEN3_OUTPUT, 37))
    answer.start()
    chunks = list(client.chat.completions.create(**ask, stream=True))
    answer.join()
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == \
        choice.message.model_extra["reasoning_content"]
    streamed: dict = {}
    for d in deltas:
        for call in d.tool_calls or ():
            if call.id is not None:
                assert call.index not in streamed and call.function.name
                streamed[call.index] = [call.function.name, ""]
            streamed[call.index][1] += call.function.arguments or ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == \
        [(name, args) for _, name, args in calls]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert not any(c.choices[0].finish_reason for c in chunks[:-1])


def test_the_server_refuses_unknown_parser_names():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'qwen'"):
        OpenAIService(tool_call_parser="qwen")
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'o1'"):
        OpenAIService(reasoning_parser="o1")


def test_tool_choice_none_and_no_tools_parse_no_calls(qwen3_fake):
    fe, client = qwen3_fake
    for n, extra in enumerate(({"tools": [WEATHER], "tool_choice": "none"}, {}), start=1):
        answer = threading.Thread(target=_answer, args=(fe, n, QWEN3_OUTPUT, 5))
        answer.start()
        out = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Hi"}], max_tokens=400,
            **extra)
        answer.join()
        prompt = "".join(map(chr, fe.submitted[-1].prompt_ids))
        assert ("get_weather" in prompt) == bool(extra)      # rendered, yet not parsed
        (choice,) = out.choices
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == QWEN3_OUTPUT.split("</think>\n\n")[1]
        assert choice.message.model_extra["reasoning_content"] == \
            "The user wants Oslo's weather.\n"


# ---- a router deployment answers like a single process ------------------------------

@pytest.mark.slow
def test_a_router_deployment_answers_http_like_one_process(llm):
    from tests.support.deployments import Procs   # processes killed at the end whatever happens

    procs = Procs()
    common = ["--max_model_len", "64", "--nowarmup", "--host", "127.0.0.1"]
    try:
        router = procs.start(["--role", "router", "--port", "0", "--http_port", "0",
                              "--internal_port", "0"] + common)
        internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
        port = int(procs.wait_line(router, r"HTTP .* on http://127\.0\.0\.1:(\d+)").group(1))
        status, _, body = request(port, "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "starting"
        for role, mesh in (("prefill", "prefill=1"), ("decode", "decode=1")):
            procs.start(["--role", role, "--mesh", mesh, "--port", "0", "--router", internal,
                         "--kv_transport", "grpc"] + common)
        procs.wait_line(router, r"jaxpd serving")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=120)
        ref = llm.generate("The cat", SamplingParams(**GREEDY))[0]
        out = client.completions.create(model=MODEL, prompt="The cat", **GREEDY,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref.token_ids
        assert out.choices[0].text == ref.text
        ref_chat = llm.chat(CHAT, SamplingParams(**GREEDY))[0]
        chunks = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                **GREEDY)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref_chat.text
        stream = client.completions.create(model=MODEL, prompt="The cat", stream=True,
                                           max_tokens=60, temperature=0,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        for _ in range(3):   # decoding: the decode worker holds the request's pages
            next(chunks)
        stream.close()
        deadline = time.monotonic() + 60
        while True:   # the decode worker freed the cancelled request's slot and pages
            status, _, body = request(port, "GET", "/health")
            health = json.loads(body)
            if health["pages_used"] == 0 and health["slots_active"] == 0:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert status == 200 and health["role"] == "router" and health["slots_total"] > 0
    finally:
        procs.close()
