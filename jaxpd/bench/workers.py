"""Worker processes a benchmark starts and stops itself: `python -m jaxpd.launch --role
prefill|decode` children whose output is drained on a thread and searched for the
address they serve on."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

START_TIMEOUT_S = 600


class LaunchedWorker:
    """A `python -m jaxpd.launch` worker child. `XLA_FLAGS` is not inherited: the
    launcher sizes the virtual CPU devices from its own `--mesh`."""

    def __init__(self, args: list[str]):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.args = list(args)
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxpd.launch"] + self.args, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True,
                         name="jaxpd-bench-worker-output").start()

    @property
    def is_follower(self) -> bool:
        """A follower process of a role spanning processes: it serves no address."""
        a = self.args
        return "--process_id" in a and a[a.index("--process_id") + 1] != "0"

    def address(self, timeout: float = START_TIMEOUT_S) -> str | None:
        """host:port it serves on, once it says so (after its warm-up); a follower's
        None once it has joined its mesh. RuntimeError with its last output if it exits
        first, TimeoutError if it says nothing in time."""
        deadline = time.monotonic() + timeout
        pattern = r"follower \d+/\d+ of the mesh" if self.is_follower else r"worker on (\S+)"
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m.group(1) if m.groups() else None
            if self.proc.poll() is not None:
                raise RuntimeError("worker exited:\n" + "".join(self.lines[-30:]))
            time.sleep(0.1)
        raise TimeoutError("worker did not start:\n" + "".join(self.lines[-30:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_all(arg_lists: list[list[str]]) -> tuple[list[LaunchedWorker], list[str | None]]:
    """Start one worker per argument list (they warm up concurrently); their
    addresses in the same order (None for a follower). Every child is stopped if any fails to come up."""
    workers = [LaunchedWorker(args) for args in arg_lists]
    try:
        return workers, [w.address() for w in workers]
    except BaseException:
        for w in workers:
            w.close()
        raise
