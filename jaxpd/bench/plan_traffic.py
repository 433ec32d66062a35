"""`python -m jaxpd.bench.plan_traffic`: what a multi-process role's plan costs.

Starts a leader and a follower (`engine.multihost`: jax.distributed on this machine,
no model), and has the leader publish the plan of prefill batches of each shape: a
`run` (tokens, lengths, sampling rows) and a `take` (every row's pages). Prints a
table (bytes per message, publish time, leader -> follower latency) and saves JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

SHAPES = [(1, 64), (8, 128), (8, 512), (4, 1024)]      # (batch rows, bucket tokens)


def _role(process_id: int, coordinator: str, repeats: int, token: str) -> None:
    from jaxpd.engine.multihost import PlanChannel, ProcessGroup, _pack_array, initialize
    from jaxpd.engine.sampler import SamplingArrays
    group = ProcessGroup(2, process_id, coordinator)
    initialize(group)
    channel = PlanChannel(group, token.encode())
    if process_id == 1:
        got = []
        while True:
            msg = channel.receive(threading.Event())
            if msg["op"] == "stop":
                break
            got.append((time.time(), msg.get("sent", 0.0)))
        print(json.dumps([now - sent for now, sent in got]), flush=True)
        return
    rows = []
    for batch, length in SHAPES:
        tokens = np.zeros((batch, length), np.int32)
        lengths = np.full(batch, length, np.int32)
        sampling = SamplingArrays.empty(batch)
        for _ in range(repeats):
            for message in ({"op": "run", "tokens": _pack_array(tokens),
                             "lengths": _pack_array(lengths),
                             "floats": _pack_array(sampling.floats),
                             "ints": _pack_array(sampling.ints)},
                            {"op": "take", "rows": [[i, 0, length // 16] for i in range(batch)]}):
                message["sent"] = time.time()
                before = channel.sent_bytes
                channel.publish(message)
                rows.append({"batch": batch, "tokens": length, "op": message["op"],
                             "bytes": channel.sent_bytes - before,
                             "publish_us": channel.publish_s[-1] * 1e6})
            time.sleep(0.002)
    channel.publish({"op": "stop"})
    print(json.dumps(rows), flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m jaxpd.bench.plan_traffic",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50, help="batches of each shape")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--role", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    token = "plan-traffic-bench-token-0123456789"
    if a.role is not None:
        _role(a.role, a.coordinator, a.repeats, token)
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpd.bench.plan_traffic", "--role",
                               str(i), "--coordinator", coordinator, "--repeats",
                               str(a.repeats)], stdout=subprocess.PIPE, text=True, env=env)
             for i in (0, 1)]
    outs = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1])
            for proc in procs]
    sent, latencies = outs[0], outs[1]
    for row, latency in zip(sent, latencies):
        row["latency_us"] = latency * 1e6
    table = []
    print(f"{'batch x tokens':>15} {'op':>5} {'bytes':>8} {'publish p50/p99 us':>20} "
          f"{'to follower p50/p99 us':>24}")
    for batch, length in SHAPES:
        for op in ("run", "take"):
            rs = [r for r in sent if (r["batch"], r["tokens"], r["op"]) == (batch, length, op)]
            pub = np.percentile([r["publish_us"] for r in rs], [50, 99])
            lat = np.percentile([r["latency_us"] for r in rs], [50, 99])
            table.append({"batch": batch, "tokens": length, "op": op, "bytes": rs[0]["bytes"],
                          "publish_us_p50": pub[0], "publish_us_p99": pub[1],
                          "latency_us_p50": lat[0], "latency_us_p99": lat[1]})
            print(f"{f'{batch} x {length}':>15} {op:>5} {rs[0]['bytes']:>8} "
                  f"{f'{pub[0]:.0f} / {pub[1]:.0f}':>20} {f'{lat[0]:.0f} / {lat[1]:.0f}':>24}")
    result = {"rows": table, "repeats": a.repeats}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
