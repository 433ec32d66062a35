"""A worker's heartbeat while something holds its GIL (`jaxpd.serving.heartbeat`): its
sidecar process beats for it as long as it makes progress, so a worker busy on one core
is never dropped, while a frozen one still is."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxpd.default_model import default_model_dir
from jaxpd.serving.heartbeat import process_progress, should_beat
from jaxpd.serving.role_rpc import RoleClient
from jaxpd.serving.router import Router, RouterConfig
from tests.support.internal_plane import AUTH, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S, LEASE_S = 0.2, 1.0


def test_the_sidecar_beats_only_for_a_late_worker_that_progresses():
    hb = 1.0
    assert should_beat(10.0, 8.0, 8.5, hb, stopped=False, cpu_advanced=True)
    assert not should_beat(10.0, 9.0, 8.5, hb, False, True)     # its own beats are on time
    assert not should_beat(10.0, 8.0, 9.5, hb, False, True)     # the sidecar beat just now
    assert not should_beat(10.0, 8.0, 8.5, hb, False, False)    # no CPU used: stuck
    assert not should_beat(10.0, 8.0, 8.5, hb, True, True)      # stopped (SIGSTOP)


def test_progress_reads_a_process_state_and_cpu_time():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_until(lambda: process_progress(child.pid) is not None)
        stopped, ticks = process_progress(child.pid)
        assert not stopped and ticks >= 0
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_progress(child.pid)[0])
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert process_progress(2 ** 22 + 12345) is None                   # no such process


def _wire():
    return {"request_id": "gil-1", "prompt_ids": [5, 6, 7], "output_ids": [], "seed": 1,
            "stop_ids": [], "params": {"max_tokens": 2, "temperature": 0.0, "top_k": 0,
                                       "top_p": 1.0, "seed": None, "stop_token_ids": [],
                                       "ignore_eos": True}}


class _Worker:
    """tests/support/gil_worker.py in a process of its own, its output collected."""

    def __init__(self, router_address: str, hold_s: float, sidecar: bool):
        env = {**os.environ, "PYTHONPATH": ROOT}
        env.pop("XLA_FLAGS", None)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "support", "gil_worker.py"),
             default_model_dir(), router_address, str(hold_s), "1" if sidecar else "0"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        threading.Thread(target=lambda: [self.lines.append(x) for x in self.proc.stdout],
                         daemon=True).start()

    def line(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for x in list(self.lines):
                if (m := re.search(pattern, x)):
                    return m
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in:\n{''.join(self.lines)}")

    def close(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def router():
    router = Router(default_model_dir(), RouterConfig(
        max_model_len=128, heartbeat_s=HEARTBEAT_S, lease_s=LEASE_S, stall_timeout_s=60),
        auth=AUTH)
    yield router, f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
    router.shutdown()


@pytest.mark.parametrize("sidecar", [True, False])
def test_a_worker_busy_on_one_core_with_its_gil_held_keeps_its_lease(router, sidecar):
    """A prefill worker pinned to one core holds its GIL in one C call (as jaxlib does
    writing a program to the compilation cache) for four leases during a prefill: its
    sidecar beats meanwhile, so the router never drops it. Without the sidecar (the
    control) the same worker loses its lease."""
    router, address = router
    worker = _Worker(address, hold_s=4 * LEASE_S, sidecar=sidecar)
    try:
        worker_address = worker.line(r"worker on (\S+)").group(1)
        wait_until(lambda: worker_address in router.live_workers(), timeout=60)
        call = RoleClient(worker_address, AUTH).prefill(_wire(), "127.0.0.1:1", timeout=120)
        held = float(worker.line(r"held the GIL for ([\d.]+) s").group(1))
        assert held > LEASE_S                  # else the test would prove nothing
        time.sleep(LEASE_S)                    # a lapsed lease is noticed by now
        dropped = router.counters.snapshot()["workers_dropped"]
        if sidecar:
            assert dropped == 0 and worker_address in router.live_workers()
        else:
            assert dropped >= 1
        call.cancel()
    finally:
        worker.close()


def test_a_frozen_worker_loses_its_lease_despite_its_sidecar(router):
    """SIGSTOP freezes the worker, which then uses no CPU: its sidecar does not beat for
    it, and the router drops it when the lease runs out."""
    router, address = router
    worker = _Worker(address, hold_s=0, sidecar=True)
    try:
        worker_address = worker.line(r"worker on (\S+)").group(1)
        wait_until(lambda: worker_address in router.live_workers(), timeout=60)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        wait_until(lambda: worker_address not in router.live_workers(), timeout=30)
        assert router.counters.snapshot()["workers_dropped"] == 1
    finally:
        worker.close()
