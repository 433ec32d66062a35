"""Request outputs go to the sink their consumer chose (`jaxpd.output_sink`): blocking
for the library, an asyncio queue for the servers and the router, with no thread per
request; a slow reader is bounded; a cancel reaches the worker at once."""
import asyncio
import json
import threading
import time
import types

import pytest

from jaxpd.default_model import default_model_dir
from jaxpd.frontend import Frontend
from jaxpd.output_sink import SLOW_READER, AsyncOutputs, EventQueue, MergedEvents
from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from tests.support.aio_decode_worker import AioDecodeWorker


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _request(rid="r", max_tokens=8) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    r.transition(State.PREFILLING)
    r.transition(State.DECODING)
    return r


def test_a_request_past_its_sinks_bound_aborts_itself_with_the_reason():
    r = _request(max_tokens=100)
    r.events = EventQueue(max_buffered=3)
    assert [r.append_token(5, 0.0) for _ in range(3)] == [False] * 3
    assert r.append_token(5, 0.0) is True            # the fourth unread event: cut off
    assert r.state is State.ABORTED and r.abort_reason == SLOW_READER
    events = [r.events.get_nowait() for _ in range(5)]
    assert events[-1] == ([], "abort") and r.events.empty()
    # a reader that keeps up is never cut off
    r = _request(max_tokens=10)
    r.events = EventQueue(max_buffered=1)
    for _ in range(10):
        r.append_token(5, 0.0)
        assert r.events.get_nowait()[0] == [5]
    assert r.finish_reason == "length" and r.events.get_nowait() == ([], "length")


def test_merged_events_tag_each_request_and_bound_each_alone():
    merged = MergedEvents(2, max_buffered=2)
    a, b = _request("a", 100), _request("b", 100)
    a.events, b.events = merged.sinks
    a.append_token(1, 0.0)
    b.append_token(2, 0.0)
    a.append_token(3, 0.0)
    assert [merged.get() for _ in range(3)] == [(0, ([1], None)), (1, ([2], None)),
                                                (0, ([3], None))]
    for _ in range(2):
        assert not b.append_token(4, 0.0)
    assert b.append_token(4, 0.0) and b.abort_reason == SLOW_READER
    assert not a.is_final                     # the other request's bound is its own


def test_async_outputs_hand_events_from_another_thread_to_the_loop():
    async def main():
        outputs = AsyncOutputs(asyncio.get_running_loop(), 2)
        requests = [_request(str(i), 50) for i in range(2)]
        for r, sink in zip(requests, outputs.sinks):
            r.events = sink

        def engine():          # a burst from another thread: a few wake-ups, no loss
            for _ in range(50):
                for r in requests:
                    r.append_token(9, 0.0)
        thread = threading.Thread(target=engine)
        thread.start()
        got = {0: [], 1: []}
        finished = 0
        while finished < 2:
            i, (ids, finish) = await asyncio.wait_for(outputs.get(), 10)
            got[i] += ids
            finished += finish is not None
        thread.join()
        return got
    got = asyncio.run(main())
    assert got == {0: [9] * 50, 1: [9] * 50}


class _HeldFrontend(Frontend):
    """Requests that stay WAITING (nothing produces tokens) until the test says."""

    def __init__(self):
        self.config = types.SimpleNamespace(max_prompt_len=16, max_model_len=32, mesh="fake=1")
        self.model_config = types.SimpleNamespace(vocab_size=100, eos_token_ids=(2,))
        self.model_path, self.tokenizer = "/models/fake", None
        self.submitted: list[Request] = []
        self._lock = threading.Lock()
        self._next = 0

    def new_request_id(self):
        with self._lock:
            self._next += 1
            return f"held-{self._next}"

    def submit(self, request):
        with self._lock:
            self.submitted.append(request)
        return request

    def abort(self, request_id, reason="cancelled"):
        with self._lock:
            found = [r for r in self.submitted if r.request_id == request_id]
        return any(r.abort(reason) for r in found)

    def stats(self):
        return {"mesh": "fake=1"}


async def _sse_client(port: int, body: dict, started: asyncio.Event | None = None) -> list:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    chunks = []
    while True:
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            chunks.append(line[6:].strip())
            if chunks[-1] == b"[DONE]":
                break
    writer.close()
    return chunks


@pytest.mark.slow
def test_http_streams_hold_no_thread_each():
    """300 SSE streams open at once: the HTTP server's threads do not grow with them."""
    from jaxpd.serving.http import HttpServer, OpenAIService
    fe = _HeldFrontend()
    server = HttpServer(OpenAIService(model_names=("fake",)), port=0)
    server.attach(fe)
    n = 300
    try:
        baseline = threading.active_count()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        body = {"model": "fake", "prompt": [5, 6], "max_tokens": 2, "stream": True,
                "return_token_ids": True}
        clients = [asyncio.run_coroutine_threadsafe(_sse_client(server.port, body), loop)
                   for _ in range(n)]
        _wait(lambda: len(fe.submitted) == n, timeout=60)
        # the test's own client loop is one thread; the server's prep pool has 4
        assert threading.active_count() - baseline <= 1 + 4
        for r in list(fe.submitted):
            r.append_token(7, time.perf_counter())
            r.append_token(7, time.perf_counter())
        outs = [c.result(60) for c in clients]
        assert all(out[-1] == b"[DONE]" for out in outs)
        assert all(json.loads(out[-2])["choices"][0]["finish_reason"] == "length"
                   for out in outs)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    finally:
        server.stop(grace_s=0)


def test_router_relays_hundreds_of_streams_on_one_loop_and_cancels_at_once():
    """256 requests through a router to a decode worker holding every stream open: the
    router's threads do not grow; an abort cancels the worker's stream at once; the
    rest then finish."""
    from jaxpd.serving.router import Router, RouterConfig
    worker = AioDecodeWorker()
    router = Router(default_model_dir(), RouterConfig(max_model_len=512, lease_s=120.0))
    try:
        worker.register(f"127.0.0.1:{router.listen('127.0.0.1', 0)}")
        _wait(router.ready)
        baseline = threading.active_count()
        n = 256
        requests = [router.submit(router.make_request(
            prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=3)))
            for _ in range(n)]
        _wait(lambda: worker.num_open == n)
        assert threading.active_count() - baseline <= 4
        victim = requests[0]
        assert router.abort(victim.request_id, "client went away")
        _wait(lambda: worker.num_cancelled == 1, timeout=5)
        worker.open_gate()
        outs = [router._wait(r) for r in requests[1:]]
        assert all(o.token_ids == [7, 7, 7] and o.finish_reason == "length" for o in outs)
        assert victim.abort_reason == "client went away"
        _wait(lambda: worker.num_open == 0)
        counts = router.counters.snapshot()
        assert counts["finished"] == n - 1 and counts["aborted"] == 1
    finally:
        router.shutdown()
        worker.close()
