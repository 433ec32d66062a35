"""N concurrent SSE streams against a deployment this script starts on this machine.

    python launch/stream_load.py --deployment router --streams 256 1000
    python launch/stream_load.py --deployment single --streams 32 --max_tokens 64
    python launch/stream_load.py --code /path/to/other/checkout ...   (its servers)

`router`: a router, one prefill and one decode process (`python -m jaxpd.launch`, the
built-in model unless --model, KV over gRPC); `single`: one process serving
prefill=1,decode=1. Every stream is one `/v1/chat/completions` call with `stream: true`
from one asyncio client (one thread). While a run goes, each server process's thread
count and resident memory are read from /proc/PID/status every 50 ms.

Reported per run: streams completed (every chunk up to `data: [DONE]`, with a
finish_reason) and refused (the status, e.g. 429); peak threads per process; resident
memory at rest and at the peak, and their difference per stream in flight at the peak;
CPU time per output token (user + system, a figure other load on the host disturbs
less than throughput does);
output tokens per second (chunks with text, over the run's wall time); TTFT and ITL
(gaps between a stream's chunks) p50/p90; open files per process; at the end, each
process's exit code and time from SIGTERM to exit. With --idle N, N TCP
connections to the HTTP port stay open and silent during the runs. A table is printed
and everything is saved as JSON (--out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

_READY_S = 1200.0


class Server:
    """One `python -m jaxpd.launch` process, its output read for the lines we need."""

    def __init__(self, name: str, args: list[str], env: dict):
        self.name = name
        # cwd is the checkout: `-m` puts the working directory first on sys.path.
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxpd.launch", *args], env=env,
                                     cwd=env["PYTHONPATH"].split(os.pathsep)[0],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()

    def wait_line(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + _READY_S
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = re.search(pattern, line)
                    if m:
                        return m
                seen = len(self.lines)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n" + "\n".join(self.lines[-30:]))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no line matching {pattern!r}")
                self._cond.wait(1.0)

    def stop(self) -> dict:
        """SIGTERM, then SIGKILL after 30 s: {"exit_code", "exit_s" (signal to exit)}."""
        started = time.monotonic()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return {"exit_code": self.proc.returncode, "exit_s": time.monotonic() - started}


def status_of(pid: int) -> tuple[int, int, int]:
    """(threads, resident KiB, open files) of a process, from /proc/PID."""
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return threads, rss, len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Peak threads and memory of some processes, read every `every_s` on a thread."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.05):
        self.pids, self.every_s = pids, every_s
        self.peak = {name: {"threads": 0, "rss_kib": 0, "fds": 0} for name in pids}
        self.rest = {name: dict(zip(("threads", "rss_kib", "fds"), status_of(pid)))
                     for name, pid in pids.items()}
        self.cpu_s = {name: cpu_s_of(pid) for name, pid in pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, pid in self.pids.items():
                try:
                    threads, rss, fds = status_of(pid)
                except OSError:
                    continue
                peak = self.peak[name]
                peak["threads"] = max(peak["threads"], threads)
                peak["rss_kib"] = max(peak["rss_kib"], rss)
                peak["fds"] = max(peak["fds"], fds)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_s = {name: cpu_s_of(pid) - self.cpu_s[name] for name, pid in self.pids.items()}


async def one_stream(port: int, body: dict, timeout_s: float) -> dict:
    """One streamed chat completion: its status, chunk times and how it ended."""
    start = time.perf_counter()
    data = json.dumps(body).encode()
    out = {"status": None, "times": [], "finish": None, "error": None}
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        out["error"] = f"connect: {e}"
        return out
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: load\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(data), data))
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            status_line = await reader.readline()
            out["status"] = int(status_line.split()[1]) if status_line else None
            while out["status"] == 200:
                line = await reader.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message")
                    break
                choice = chunk["choices"][0]
                if choice.get("delta", {}).get("content"):
                    out["times"].append(time.perf_counter() - start)
                if choice.get("finish_reason"):
                    out["finish"] = choice["finish_reason"]
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        out["error"] = repr(e)
    finally:
        writer.close()
    return out


async def run_streams(port: int, n: int, max_tokens: int, timeout_s: float) -> tuple[list, float]:
    body = {"model": "default_model", "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about lists and strings."}]}
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(port, body, timeout_s) for _ in range(n)))
    return results, time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results: list[dict], wall_s: float, sampler: Sampler, n: int) -> dict:
    completed = [r for r in results if r.get("done") and r["finish"] in ("stop", "length")
                 and not r["error"]]
    refused: dict[str, int] = {}
    for r in results:
        if r["status"] != 200 or r["error"]:
            key = str(r["status"] if r["status"] != 200 else r["error"])[:60]
            refused[key] = refused.get(key, 0) + 1
    ttft = [r["times"][0] for r in completed if r["times"]]
    itl = [b - a for r in completed for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["times"]) for r in completed)
    procs = {}
    for name in sampler.pids:
        rest, peak = sampler.rest[name], sampler.peak[name]
        procs[name] = {"threads_rest": rest["threads"], "threads_peak": peak["threads"],
                       "rss_rest_mib": rest["rss_kib"] / 1024,
                       "rss_peak_mib": peak["rss_kib"] / 1024,
                       "kib_per_stream": (peak["rss_kib"] - rest["rss_kib"]) / n,
                       "fds_rest": rest["fds"], "fds_peak": peak["fds"],
                       "cpu_ms_per_token": (1e3 * sampler.cpu_s[name] / tokens
                                            if tokens else None)}
    return {"streams": n, "completed": len(completed), "refused": refused,
            "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9),
            "itl_mean_s": statistics.fmean(itl) if itl else None, "processes": procs}


async def all_runs(port: int, pids: dict, args) -> list[dict]:
    await run_streams(port, 4, args.max_tokens, args.timeout_s)          # warm
    idle = []
    for _ in range(args.idle):
        idle.append((await asyncio.open_connection("127.0.0.1", port))[1])
    runs = []
    for n in args.streams:
        await asyncio.sleep(2.0)
        sampler = Sampler(pids)
        results, wall = await run_streams(port, n, args.max_tokens, args.timeout_s)
        sampler.stop()
        runs.append(summarize(results, wall, sampler, n))
        runs[-1]["idle_connections"] = args.idle
    for writer in idle:
        writer.close()
    return runs


def start(deployment: str, env: dict, common: list[str]) -> tuple[list[Server], int, dict]:
    """The deployment's servers, its HTTP port, and the pids to watch by name."""
    if deployment == "single":
        s = Server("server", ["--mesh", "prefill=1,decode=1", "--port", "0",
                              "--http_port", "0", *common], env)
        port = int(s.wait_line(r"HTTP .* on http://127\.0\.0\.1:(\d+)").group(1))
        s.wait_line(r"jaxpd serving")
        return [s], port, {"server": s.proc.pid}
    router = Server("router", ["--role", "router", "--port", "0", "--http_port", "0",
                               "--internal_port", "0", *common], env)
    servers = [router]
    try:
        internal = router.wait_line(r"internal plane on (\S+)").group(1)
        port = int(router.wait_line(r"HTTP .* on http://127\.0\.0\.1:(\d+)").group(1))
        for role, mesh in (("prefill", "prefill=1"), ("decode", "decode=1")):
            servers.append(Server(role, ["--role", role, "--mesh", mesh, "--port", "0",
                                         "--router", internal, "--kv_transport", "grpc",
                                         *common], env))
        router.wait_line(r"jaxpd serving")
    except BaseException:
        for s in servers:
            s.stop()
            print(f"---- {s.name}, last lines:\n" + "\n".join(s.lines[-15:]), file=sys.stderr)
        raise
    return servers, port, {s.name: s.proc.pid for s in servers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deployment", choices=("router", "single"), default="router")
    p.add_argument("--streams", type=int, nargs="+", default=[256])
    p.add_argument("--max_tokens", type=int, default=16)
    p.add_argument("--max_model_len", type=int, default=256)
    p.add_argument("--timeout_s", type=float, default=900.0)
    p.add_argument("--code", default=None, help="a jaxpd checkout whose servers to run "
                   "(its root goes first on PYTHONPATH; default: this one)")
    p.add_argument("--extra", default="", help="more launch flags for every server")
    p.add_argument("--idle", type=int, default=0, help="TCP connections to open to the "
                   "HTTP port and leave idle (never a byte sent) during the runs")
    p.add_argument("--out", default="stream_load.json")
    args = p.parse_args()
    env = dict(os.environ)
    code = os.path.abspath(args.code or os.path.join(os.path.dirname(__file__), ".."))
    env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    common = ["--host", "127.0.0.1", "--max_model_len", str(args.max_model_len),
              *args.extra.split()]
    servers, port, pids = start(args.deployment, env, common)
    try:
        runs = asyncio.run(all_runs(port, pids, args))
    finally:
        stops = {s.name: s.stop() for s in servers}
    report = {"deployment": args.deployment, "code": code, "max_tokens": args.max_tokens,
              "idle_connections": args.idle, "runs": runs, "stops": stops}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    fmt = lambda x, scale=1.0, d=1: "-" if x is None else f"{x * scale:.{d}f}"
    print(f"{args.deployment} ({code}), max_tokens={args.max_tokens}, "
          f"idle connections={args.idle}")
    print("streams  done  refused             tok/s  TTFT p50  ITL p50/p90 ms  "
          + "  ".join(f"{name} thr rest/peak, KiB/stream, CPU ms/token" for name in pids))
    for r in runs:
        procs = "  ".join(f"{v['threads_rest']}/{v['threads_peak']}, "
                          f"{fmt(v['kib_per_stream'])}, {fmt(v['cpu_ms_per_token'], 1, 2)}"
                          for v in r["processes"].values())
        print(f"{r['streams']:>7} {r['completed']:>5}  {str(r['refused'] or '-'):<18}"
              f"{fmt(r['tokens_per_s']):>6}  {fmt(r['ttft_p50_s'], 1, 2):>8}  "
              f"{fmt(r['itl_p50_s'], 1e3)}/{fmt(r['itl_p90_s'], 1e3):<8}  {procs}")
    for s in servers:               # a worker the router lost explains failed streams
        for line in s.lines:
            if " dropped: " in line:
                print(f"{s.name}: {line}")
    print("on SIGTERM: " + ", ".join(f"{name} exit {v['exit_code']} after {v['exit_s']:.1f} s"
                                     for name, v in stops.items()))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
