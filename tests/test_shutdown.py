"""Shutting down: `python -m jaxpd.launch` on SIGINT stops admitting, lets a stream in
flight finish or aborts it with the reason, and exits 0, also during its start-up; a
background compile in progress does not hold the exit."""
import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxpd.engine.compile.background import BackgroundCompiler
from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.serving.server import SERVICE_NAME

# Only safety nets against a hang; no assertion is about how long anything took.
_WAIT_S = 300

# The built-in model, small: one prefill batch size, a short context.
SMALL = ["--max_model_len=256", "--max_prefill_batch=1", "--slots_per_shard=2",
         "--port=0", "--http_port=-1"]


class _Counter:
    def note(self, name, key):
        pass


class _BlockedCompile:
    """A `jax.stages.Lowered` stand-in whose compile runs until `release` is set."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def compile(self):
        self.started.set()
        self.release.wait(_WAIT_S)
        return "compiled"


def test_closing_with_no_wait_abandons_the_compile_in_progress():
    compiler = BackgroundCompiler("test", _Counter())
    blocked, queued = _BlockedCompile(), _BlockedCompile()
    compiler.request("blocked", lambda: blocked)
    compiler.request("queued", lambda: queued)
    assert blocked.started.wait(_WAIT_S)
    queued.release.set()                         # were it compiled, it would not block
    compiler.close(timeout_s=0)                  # returns with the compile still running
    thread = compiler._thread
    assert thread.is_alive() and compiler.get("blocked") is None
    blocked.release.set()
    thread.join(_WAIT_S)
    assert not thread.is_alive()                 # it stopped after that compile...
    assert compiler.get("blocked") == "compiled"
    assert not queued.started.is_set() and compiler.get("queued") is None   # ...not the next


def _stream_until_sigint(procs, timeout_s: str):
    """Start the launcher, open a long stream, SIGINT it once the first tokens came;
    returns (process, stream responses after the signal, health seen, a refusal)."""
    p = procs.start(SMALL + [f"--shutdown_timeout_s={timeout_s}"])
    port = procs.wait_line(p, r"listening on 127\.0\.0\.1:(\d+)").group(1)
    procs.wait_line(p, r"jaxpd serving", timeout=_WAIT_S)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = jaxpd_pb2_grpc.GenerationStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stream = stub.Generate(jaxpd_pb2.GenerateRequest(
            prompt="The list type", max_tokens=240, ignore_eos=True, temperature=0.0),
            timeout=_WAIT_S)
        first = next(stream)
        assert first.token_ids
        p.send_signal(signal.SIGINT)
        status = None
        while status != health_pb2.HealthCheckResponse.NOT_SERVING:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                      timeout=10).status
            except grpc.RpcError:                # already stopped listening
                break
        refused = None
        try:
            stub.Complete(jaxpd_pb2.GenerateRequest(prompt="import", max_tokens=2),
                          timeout=30)
        except grpc.RpcError as e:
            refused = e.code()
        rest = list(stream)
    return p, [first] + rest, refused


@pytest.mark.slow
def test_sigint_lets_a_stream_in_flight_finish_then_exits_zero(procs):
    p, responses, refused = _stream_until_sigint(procs, "120")
    assert refused == grpc.StatusCode.UNAVAILABLE         # no new request once stopping
    assert responses[-1].finish_reason == "length", procs.tails()
    assert sum(len(r.token_ids) for r in responses) == 240
    assert p.wait(_WAIT_S) == 0, procs.tails()
    assert "jaxpd shutting down" in "".join(p.lines)


@pytest.mark.slow
def test_sigint_aborts_a_stream_past_the_shutdown_timeout_and_exits_zero(procs):
    p, responses, refused = _stream_until_sigint(procs, "0")
    # Refused, or cut off by the server going away at once: never served.
    assert refused in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    last = responses[-1]
    # Finished already, or cut off with the reason saying why.
    assert last.finish_reason == "length" or (
        last.finish_reason == "abort" and last.metrics.abort_reason == "shutdown"), last
    assert p.wait(_WAIT_S) == 0, procs.tails()
    assert "terminate called" not in "".join(p.lines)


@pytest.mark.slow
def test_sigint_while_starting_stops_the_warm_up_and_exits_zero(procs):
    p = procs.start(["--port=0", "--http_port=-1"])   # the full warm-up: many steps
    procs.wait_line(p, r"compiling \d+/\d+: ", timeout=_WAIT_S)
    p.send_signal(signal.SIGINT)
    assert p.wait(_WAIT_S) == 0, procs.tails()
    out = "".join(p.lines)
    assert "jaxpd stopped while starting" in out and "jaxpd serving" not in out, out
