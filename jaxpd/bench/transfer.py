"""Throughput of the three connectors: `python -m jaxpd.bench.transfer [--json out.json]`.

- device_put:      one process, 8 CPU devices, prefill mesh devices[:4] -> decode mesh devices[4:]
- transfer_server: two processes (4 devices each) over 127.0.0.1
- grpc_stream:     two processes (4 devices each) over 127.0.0.1

KV pages are float32 [L=8, P, S=16, K=8, H=128] (128 KiB of k+v per page-layer), sent
sharded over K ('tp') and placed sharded over H ('dp'), so every path also reshards.
Time is end to end: from the sender's `send` to the receiver's `place` returning, both
read on the same host's wall clock. The two-process runs go in lockstep (this process
tells the sender "GO" after the receiver reports the previous handoff), so transfers
never overlap. Each child has a hard timeout and is killed if it outlives it.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

from jaxpd.bench.host import describe_host, host_line
from jaxpd.sharding.cpu_devices import xla_flags_with_count

SHAPE_SKH = (16, 8, 128)
NUM_LAYERS = 8
BYTES_PER_PAGE = 2 * NUM_LAYERS * 16 * 8 * 128 * 4  # k and v, float32
CHILD_TIMEOUT_S = 300
METHODS = ("device_put", "transfer_server", "grpc_stream")


# -- children: each sets its device count before jax is imported ------------------------

def _shardings(devices):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    send = NamedSharding(Mesh(np.array(devices[:4]), ("tp",)), P(None, None, None, "tp"))
    place = NamedSharding(Mesh(np.array(devices[-4:]), ("dp",)), P(None, None, None, None, "dp"))
    return send, place


def _handoffs(sizes_mib: list[int]):
    """One (k, v) pair per size, on the sender's sharding."""
    import jax
    import jax.numpy as jnp
    send_sharding, _ = _shardings(jax.devices())
    out = {}
    for size in sizes_mib:
        shape = (NUM_LAYERS, size * (1 << 20) // BYTES_PER_PAGE, *SHAPE_SKH)
        k = jax.device_put(jnp.ones(shape, jnp.float32), send_sharding)
        out[size] = (k, jax.device_put(-jnp.ones(shape, jnp.float32), send_sharding))
    return jax.block_until_ready(out)


def _report(method: str, size: int, t0: float, stats) -> None:
    print("RESULT " + json.dumps({"method": method, "size_mib": size, "num_bytes": stats.num_bytes,
                                  "seconds": time.time() - t0, "place_seconds": stats.seconds}),
          flush=True)


def _child_local(sizes_mib: list[int], num_runs: int) -> None:
    import jax
    from jaxpd.transfer.connector import KVHandoff
    from jaxpd.transfer.device_put import DevicePutConnector
    connector = DevicePutConnector()
    _, place_sharding = _shardings(jax.devices())
    for size, (k, v) in _handoffs(sizes_mib).items():
        for _ in range(num_runs):
            t0 = time.time()
            connector.send(KVHandoff("bench", 1, 0, k, v))
            *_, stats = connector.place(connector.receive(timeout=10), place_sharding)
            _report("device_put", size, t0, stats)


def _child_receiver(method: str, num_handoffs: int) -> None:
    import jax
    if method == "transfer_server":
        from jaxpd.transfer.transfer_server import TransferServerReceiver
        connector = TransferServerReceiver()
        print(f"ADDR {connector.control_address}", flush=True)
    else:
        from jaxpd.transfer.grpc_stream import GrpcReceiver, GrpcStreamOptions
        connector = GrpcReceiver(options=GrpcStreamOptions(rpc_timeout_s=120))
        print(f"ADDR {connector.address}", flush=True)
    _, place_sharding = _shardings(jax.devices())
    for _ in range(num_handoffs):
        handoff = connector.receive(timeout=120)
        if handoff is None:
            raise TimeoutError("no handoff arrived within 120 s")
        *_, stats = connector.place(handoff, place_sharding)
        _report(method, handoff.payload["size_mib"], handoff.payload["t0"], stats)
    connector.close()


def _child_sender(method: str, address: str, sizes_mib: list[int]) -> None:
    from jaxpd.transfer.connector import KVHandoff
    if method == "transfer_server":
        from jaxpd.transfer.transfer_server import TransferServerSender
        connector = TransferServerSender(decode_control_address=address)
    else:
        from jaxpd.transfer.grpc_stream import GrpcSender, GrpcStreamOptions
        connector = GrpcSender(decode_address=address,
                               options=GrpcStreamOptions(rpc_timeout_s=120))
    handoffs = _handoffs(sizes_mib)
    print("READY", flush=True)
    for line in sys.stdin:
        size = int(line.split()[1])
        k, v = handoffs[size]
        connector.send(KVHandoff("bench", 1, 0, k, v, payload={"size_mib": size, "t0": time.time()}))
    connector.close()


# -- orchestration ---------------------------------------------------------------------

class _Child:
    """A `python -m jaxpd.bench.transfer --child ...` process with `num_devices` CPUs."""

    def __init__(self, args: list[str], num_devices: int):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags_with_count(
            os.environ.get("XLA_FLAGS", ""), num_devices))
        self.proc = subprocess.Popen(
            ["timeout", "-s", "KILL", str(CHILD_TIMEOUT_S), sys.executable, "-m",
             "jaxpd.bench.transfer", *args],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"child exited with {self.proc.returncode}") from None
                continue
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise TimeoutError(f"child did not print {prefix!r} within {timeout} s")

    def write(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _run_local(sizes_mib: list[int], num_runs: int) -> list[dict]:
    child = _Child(["--child", "local", "--sizes-mib", *map(str, sizes_mib),
                    "--runs", str(num_runs)], num_devices=8)
    try:
        return [json.loads(child.expect("RESULT")) for _ in range(len(sizes_mib) * num_runs)]
    finally:
        child.stop()


def _run_pair(method: str, sizes_mib: list[int], num_runs: int) -> list[dict]:
    sizes = [str(s) for s in sizes_mib]
    receiver = _Child(["--child", "receiver", "--method", method,
                       "--num-handoffs", str(len(sizes_mib) * num_runs)], num_devices=4)
    sender = None
    try:
        address = receiver.expect("ADDR")
        sender = _Child(["--child", "sender", "--method", method, "--address", address,
                         "--sizes-mib", *sizes], num_devices=4)
        sender.expect("READY")
        results = []
        for size in sizes_mib:
            for _ in range(num_runs):
                sender.write(f"GO {size}")
                results.append(json.loads(receiver.expect("RESULT")))
        return results
    finally:
        if sender is not None:
            sender.stop()
        receiver.stop()


def summarize(results: list[dict], num_warmup: int) -> list[dict]:
    """Median over the runs after the warm-up ones, per method and size."""
    rows = []
    for method in METHODS:
        for size in sorted({r["size_mib"] for r in results if r["method"] == method}):
            runs = [r for r in results if r["method"] == method and r["size_mib"] == size]
            timed = runs[num_warmup:]
            seconds = statistics.median(r["seconds"] for r in timed)
            rows.append({"method": method, "size_mib": size, "num_bytes": runs[0]["num_bytes"],
                         "num_runs": len(timed), "seconds": seconds,
                         "place_seconds": statistics.median(r["place_seconds"] for r in timed),
                         "gb_per_s": runs[0]["num_bytes"] / seconds / 1e9})
    return rows


def bench(sizes_mib: list[int], num_runs: int, num_warmup: int) -> list[dict]:
    """Run every method on every size; return the summary rows."""
    results = _run_local(sizes_mib, num_runs)
    for method in ("transfer_server", "grpc_stream"):
        results += _run_pair(method, sizes_mib, num_runs)
    return summarize(results, num_warmup)


def print_table(rows: list[dict]) -> None:
    print(host_line(describe_host()))
    print(f"{'method':<16}{'KV MiB':>8}{'ms e2e':>10}{'ms place':>10}{'GB/s':>8}")
    for r in rows:
        print(f"{r['method']:<16}{r['size_mib']:>8}{r['seconds'] * 1e3:>10.1f}"
              f"{r['place_seconds'] * 1e3:>10.1f}{r['gb_per_s']:>8.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxpd.bench.transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 32, 128],
                        help="k+v bytes per handoff, MiB (multiples of 1)")
    parser.add_argument("--runs", type=int, default=4, help="runs per size, warm-up included")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the summary rows here")
    parser.add_argument("--child", choices=["local", "receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=["transfer_server", "grpc_stream"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--num-handoffs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "local":
        return _child_local(args.sizes_mib, args.runs)
    if args.child == "receiver":
        return _child_receiver(args.method, args.num_handoffs)
    if args.child == "sender":
        return _child_sender(args.method, args.address, args.sizes_mib)
    if args.runs <= args.warmup:
        parser.error("--runs must exceed --warmup")
    rows = bench(args.sizes_mib, args.runs, args.warmup)
    print_table(rows)
    if args.json:
        import jax
        with open(args.json, "w") as f:
            json.dump({"jax_version": jax.__version__, "platform": "cpu",
                       "cpu_count": os.cpu_count(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
