"""Launcher processes on 127.0.0.1 for tests: `Procs` (started, watched, stopped), a
router + prefill + decode `deployment`, and what such tests share."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc
from jaxpd.transfer import jax_compat
from tests.engine_fixtures import mixed_prompts, reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


NUM = 8


COMMON = ["--max_model_len", "160", "--nowarmup", "--host", "127.0.0.1", "--http_port", "0"]


def router_model(tiny_hf_model):
    """(path, prompts, max tokens, their reference tokens, longer max tokens, theirs)."""
    path, hf = tiny_hf_model
    prompts = mixed_prompts(NUM, 256, seed=5)
    max_tokens = [6 + 2 * i for i in range(NUM)]
    long_tokens = [min(n * 4, 160 - len(p)) for p, n in zip(prompts, max_tokens)]
    return (path, prompts, max_tokens, reference(hf, prompts, max_tokens), long_tokens,
            reference(hf, prompts, long_tokens))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Started processes, all killed at the end whatever happens."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args, fault=None, env=None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
        env.pop("XLA_FLAGS", None)
        cmd = ([sys.executable, os.path.join(ROOT, "tests", "fault_launch.py"), fault] if fault
               else [sys.executable, "-m", "jaxpd.launch"])
        p = subprocess.Popen(cmd + args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        p.lines = []
        threading.Thread(target=lambda: [p.lines.append(l) for l in p.stdout], daemon=True).start()
        self.procs.append(p)
        return p

    def wait_line(self, p, pattern, timeout=180) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(p.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            assert p.poll() is None, "".join(p.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in:\n{''.join(p.lines)}")

    def tails(self, n: int = 30) -> str:
        """The last `n` lines of every process, for a failing assertion's message."""
        return "\n".join(f"--- {' '.join(p.args[-12:])}\n" + "".join(p.lines[-n:])
                         for p in self.procs)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def deployment(procs, path, num_decode=1, prefill_fault=None, transport="transfer_server",
                extra=(), router_extra=(), env=None):
    """Router first (it needs no jax: up at once), then workers that register on its
    internal port; returns once every worker has joined and the router serves."""
    if transport == "transfer_server" and jax_compat.unavailable_reason() is not None:
        pytest.skip(jax_compat.unavailable_reason())
    router_port = free_port()
    router_addr = f"127.0.0.1:{router_port}"
    router = procs.start(["--role", "router", "--model", path, "--port", str(router_port),
                          "--internal_port", "0"] + COMMON + list(router_extra), env=env)
    internal = procs.wait_line(router, r"internal plane on (\S+)").group(1)
    common = COMMON + ["--kv_transport", transport, "--router", internal] + list(extra)
    workers = [procs.start(["--role", "prefill", "--mesh", "prefill=2", "--model", path,
                            "--port", "0"] + common, fault=prefill_fault, env=env)]
    workers += [procs.start(["--role", "decode", "--mesh", "decode=2", "--model", path,
                             "--port", "0", "--slots_per_shard", "4"] + common, env=env)
                for _ in range(num_decode)]
    for w in workers:
        address = procs.wait_line(w, r"worker on (\S+)").group(1)
        procs.wait_line(router, rf"worker {re.escape(address)} joined")
    procs.wait_line(router, r"jaxpd serving")
    return router_addr, router, workers


def generate_all(addr, prompts, max_tokens, timeout=120):
    results = [None] * len(prompts)
    with grpc.insecure_channel(addr) as channel:
        stub = jaxpd_pb2_grpc.GenerationStub(channel)

        def one(i):
            req = jaxpd_pb2.GenerateRequest(token_ids=jaxpd_pb2.TokenIds(ids=prompts[i]),
                                            max_tokens=max_tokens[i], temperature=0.0,
                                            ignore_eos=True)
            results[i] = stub.Complete(req, timeout=timeout)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
    return results


def stream_tokens(stub, request, out: list) -> None:
    """Generate `request`, appending each token to `out` as it arrives, then the finish
    reason (or the gRPC error's code name)."""
    try:
        for msg in stub.Generate(request, timeout=300):
            out.extend(msg.token_ids)
            if msg.HasField("finish_reason"):
                out.append(msg.finish_reason)
    except grpc.RpcError as e:
        out.append(e.code().name)


# Prompts of 32+ tokens (most of them) go layer-wise in 2 parts; the rest whole.
LAYERWISE = ["--layerwise_min_tokens", "32", "--layerwise_parts", "2"]


# For tests where a prefill worker dies: the decode worker's liveness is not under test,
# and it compiles on first use (--nowarmup) on cores another test process shares, so a
# short stall clock could drop the only decode worker mid-compile (seen once in CI).
PATIENT_ROUTER = ["--stall_timeout_s", "60", "--lease_s", "30"]



def coordinator() -> str:
    """A free loopback address for a jax.distributed coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def page_bytes(path, page_size=16):
    """Bytes of one float32 KV page of the checkpoint at `path`, over every layer."""
    from jaxpd.models.source import model_config_and_tokenizer

    cfg = model_config_and_tokenizer(path)[0]
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * 4

