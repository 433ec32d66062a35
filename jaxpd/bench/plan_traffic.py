"""`python -m jaxpd.bench.plan_traffic`: what a multi-process role's plan costs.

Starts a leader and a follower (`engine.multihost`: jax.distributed on this machine,
no model), and has the leader publish the plan of prefill batches of each shape: a
`run` (tokens, lengths, sampling rows) and a `take` (every row's pages); then a decode
role's (`engine.multihost.decode`): a `step` for each (slots, block-table width), and
an `insert` of n pages bound for a follower's dp shard (the page bytes ride along) for
each page shape. Prints tables (bytes per message, publish time, leader -> follower
latency) and saves JSON.
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

from jaxpd.sharding.cpu_devices import xla_flags_with_count

SHAPES = [(1, 64), (8, 128), (8, 512), (4, 1024)]      # (batch rows, bucket tokens)
STEPS = [(8, 8), (32, 16), (64, 64)]                   # (decode slots, block-table width)
# (name, [L, S, K, H] of a page, dtype, page counts): the built-in default model on CPU
# (float32), and an 8B-class model (Llama-3-8B's shapes) in bfloat16.
PAGES = [("default", (6, 16, 4, 32), "float32", (1, 4, 16)),
         ("8b-bf16", (32, 16, 8, 128), "bfloat16", (1, 4))]


def _role(process_id: int, coordinator: str, repeats: int, token: str) -> None:
    from jaxpd.engine.multihost.plan_channel import (PlanChannel, ProcessGroup, initialize,
                                                     pack_array)
    from jaxpd.engine.multihost.decode import insert_message, step_message
    from jaxpd.engine.programs.sampler import SamplingArrays
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
            for message in ({"op": "run", "tokens": pack_array(tokens),
                             "lengths": pack_array(lengths),
                             "floats": pack_array(sampling.floats),
                             "ints": pack_array(sampling.ints)},
                            {"op": "take", "rows": [[i, 0, length // 16] for i in range(batch)]}):
                _timed(channel, message, rows, batch=batch, tokens=length, op=message["op"])
            time.sleep(0.002)
    for slots, width in STEPS:
        args = (np.zeros(slots, np.int32), np.ones(slots, bool), np.zeros(slots, np.int32),
                np.zeros((slots, width), np.int32), SamplingArrays.empty(slots),
                np.arange(slots, dtype=np.int32))
        for _ in range(repeats):
            _timed(channel, step_message(*args), rows, kind="step", slots=slots, width=width)
            time.sleep(0.002)
    for name, (layers, size, heads, dim), dtype, counts in PAGES:
        for n in counts:
            pages = np.zeros((layers, n, size, heads, dim), _dtype(dtype))
            for _ in range(max(1, repeats // 5)):
                _timed(channel, insert_message(1, list(range(n)), pages, pages, True), rows,
                       kind="insert", model=name, pages=n)
                time.sleep(0.002)
    channel.publish({"op": "stop"})
    print(json.dumps(rows), flush=True)


def _dtype(name: str):
    import ml_dtypes
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _timed(channel, message: dict, rows: list, **fields) -> None:
    message["sent"] = time.time()
    before = channel.sent_bytes
    channel.publish(message)
    rows.append({**fields, "bytes": channel.sent_bytes - before,
                 "publish_us": channel.publish_s[-1] * 1e6})


def _summary(rs: list[dict]) -> dict:
    pub = np.percentile([r["publish_us"] for r in rs], [50, 99])
    lat = np.percentile([r["latency_us"] for r in rs], [50, 99])
    return {"bytes": rs[0]["bytes"], "publish_us_p50": pub[0], "publish_us_p99": pub[1],
            "latency_us_p50": lat[0], "latency_us_p99": lat[1]}


def _print_row(label: str, op: str, row: dict) -> None:
    publish = f"{row['publish_us_p50']:.0f} / {row['publish_us_p99']:.0f}"
    latency = f"{row['latency_us_p50']:.0f} / {row['latency_us_p99']:.0f}"
    print(f"{label:>22} {op:>6} {row['bytes']:>9} {publish:>20} {latency:>24}")


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
    env = {**os.environ,
           "XLA_FLAGS": xla_flags_with_count(os.environ.get("XLA_FLAGS", ""), 1)}
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpd.bench.plan_traffic", "--role",
                               str(i), "--coordinator", coordinator, "--repeats",
                               str(a.repeats)], stdout=subprocess.PIPE, text=True, env=env)
             for i in (0, 1)]
    outs = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1])
            for proc in procs]
    sent, latencies = outs[0], outs[1]
    for row, latency in zip(sent, latencies):
        row["latency_us"] = latency * 1e6
    table, decode = [], []
    print(f"{'shape':>22} {'op':>6} {'bytes':>9} {'publish p50/p99 us':>20} "
          f"{'to follower p50/p99 us':>24}")
    for batch, length in SHAPES:
        for op in ("run", "take"):
            rs = [r for r in sent if (r.get("batch"), r.get("tokens"), r.get("op")) ==
                  (batch, length, op)]
            table.append({"batch": batch, "tokens": length, "op": op, **_summary(rs)})
            _print_row(f"{batch} x {length} tokens", op, table[-1])
    for slots, width in STEPS:
        rs = [r for r in sent if (r.get("kind"), r.get("slots"), r.get("width")) ==
              ("step", slots, width)]
        decode.append({"op": "step", "slots": slots, "width": width, **_summary(rs)})
        _print_row(f"{slots} slots x {width} pages", "step", decode[-1])
    for name, _, _, counts in PAGES:
        for n in counts:
            rs = [r for r in sent if (r.get("kind"), r.get("model"), r.get("pages")) ==
                  ("insert", name, n)]
            decode.append({"op": "insert", "model": name, "pages": n, **_summary(rs)})
            _print_row(f"{n} pages of {name}", "insert", decode[-1])
    result = {"rows": table, "decode_rows": decode, "repeats": a.repeats}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
