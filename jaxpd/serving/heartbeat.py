"""A worker's heartbeat that its own GIL cannot stop: a sidecar process.

A worker heartbeats the router from its `jaxpd-register` thread. Every Python thread of
the worker needs its GIL, and jaxlib holds the GIL through some long C++ calls: writing
a compiled program to the persistent compilation cache serializes the whole executable
with the GIL held, for seconds on a large program and longer on a loaded host. A worker
compiling beside a long prefill would then miss beats and be dropped while it works.

So each worker starts a small process of its own (no jax: grpc and msgpack) fed through
a pipe. Before each beat of its own the worker writes the body it sends (less the prefix
advertisement, which must not be sent twice); the sidecar stays quiet while those come
in time, and when they stop it sends the last body in their place every `heartbeat_s`,
but only while the worker makes progress: its process is running and has used CPU
since the sidecar's last beat (it computes or compiles). Liveness is thus the worker's
progress, seen from outside its GIL:

- a worker that dies closes the pipe: the sidecar exits and the lease runs out;
- a frozen worker (SIGSTOP) or one stuck waiting uses no CPU: the sidecar says nothing;
- a worker whose engine failed, or that stops, closes the pipe itself.

Linux only (the process's state and CPU time come from /proc); elsewhere the worker's
own beats are all there is.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import struct
import subprocess
import sys
import threading
import time

from jaxpd.auth import InternalAuth
from jaxpd.transfer.wire import pack, unpack

_log = logging.getLogger(__name__)
_FRAME = struct.Struct("<I")
MAX_FRAME = 1 << 20


def write_frame(f, message: dict) -> None:
    data = pack(message)
    f.write(_FRAME.pack(len(data)) + data)
    f.flush()


def read_frame(f) -> dict | None:
    """The next frame of `f`, or None at its end (a short or oversized one ends it too)."""
    head = f.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    data = f.read(size) if size <= MAX_FRAME else b""
    return unpack(data) if len(data) == size and size else None


def process_progress(pid: int) -> tuple[bool, int] | None:
    """(whether process `pid` is stopped or dead, its CPU time in clock ticks) from
    /proc, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()     # after "pid (comm) "
    state, utime, stime = fields[0], int(fields[11]), int(fields[12])
    return state in ("T", "t", "Z", "X"), utime + stime


def should_beat(now: float, last_update: float, last_beat: float, heartbeat_s: float,
                stopped: bool, cpu_advanced: bool) -> bool:
    """Whether the sidecar beats in the worker's place now: the worker's own beats are
    late (none for 1.5 heartbeats), the sidecar's last was a heartbeat ago or more, and
    the worker runs and has used CPU since then."""
    late = now - last_update > 1.5 * heartbeat_s
    due = now - last_beat >= heartbeat_s
    return late and due and not stopped and cpu_advanced


class HeartbeatSidecar:
    """The worker's end (see the module docstring): `update(body)` with each beat of its
    own, `close()` to stop it. `start` returns None where no sidecar can run."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self._lock = threading.Lock()

    @classmethod
    def start(cls, router_address: str, heartbeat_s: float, auth: InternalAuth
              ) -> "HeartbeatSidecar | None":
        if not sys.platform.startswith("linux"):
            return None
        try:
            # The worker's own import path: the sidecar runs the worker's jaxpd.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            proc = subprocess.Popen([sys.executable, "-m", "jaxpd.serving.heartbeat"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    env=env, close_fds=True)
            write_frame(proc.stdin, {"router": router_address, "heartbeat_s": heartbeat_s,
                                     "pid": os.getpid(), "auth": dataclasses.asdict(auth)})
        except OSError as e:
            _log.warning("no heartbeat sidecar (%s): beats stop while a long call holds "
                         "the GIL", e)
            return None
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def update(self, body: dict) -> None:
        """The body of the beat the worker sends now (without its prefix)."""
        with self._lock:
            if self._proc.stdin.closed:
                return
            try:
                write_frame(self._proc.stdin, {"body": body})
            except (OSError, ValueError):
                self._proc.stdin.close()    # it is gone: the worker's beats go on alone

    def close(self) -> None:
        """Stop beating for this worker (idempotent); the sidecar exits on the pipe's end."""
        with self._lock:
            if not self._proc.stdin.closed:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _run(stdin) -> None:
    """The sidecar: beat for the worker while it progresses, until the pipe ends."""
    from jaxpd.serving.role_rpc import send_register

    init = read_frame(stdin)
    if init is None:
        return
    router, heartbeat_s, pid = init["router"], float(init["heartbeat_s"]), int(init["pid"])
    auth = InternalAuth(**init["auth"])
    state = {"body": None, "updated": time.monotonic(), "open": True}
    lock = threading.Lock()

    def read():
        while True:
            frame = read_frame(stdin)
            with lock:
                if frame is None:
                    state["open"] = False
                    return
                state["body"], state["updated"] = frame["body"], time.monotonic()

    threading.Thread(target=read, name="jaxpd-beat-pipe", daemon=True).start()
    progress = process_progress(pid)
    last_beat, last_cpu = time.monotonic(), progress[1] if progress else 0
    while True:
        time.sleep(heartbeat_s / 4)
        with lock:
            if not state["open"]:
                return
            body, updated = state["body"], state["updated"]
        progress = process_progress(pid)
        if progress is None or body is None:
            continue
        stopped, cpu = progress
        now = time.monotonic()
        if should_beat(now, updated, last_beat, heartbeat_s, stopped, cpu > last_cpu):
            last_beat, last_cpu = now, cpu
            try:
                send_register(router, body, auth, timeout=max(heartbeat_s, 2.0))
            except Exception:   # noqa: BLE001 -- the worker's own beats handle the router's answers
                pass
        elif now - last_beat >= heartbeat_s:
            last_beat, last_cpu = now, cpu   # a window with no progress: none counts later


if __name__ == "__main__":
    _run(sys.stdin.buffer)
