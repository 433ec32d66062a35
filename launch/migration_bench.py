"""A decode worker drained during a streaming load: its requests moved with their KV
(`--migrate_on_drain`) against prefilled again elsewhere (the fallback).

    python launch/migration_bench.py --streams 8 --prompt_len 384 --max_tokens 128

Workers start with --nowarmup; a first run of each mode (`warm_*`, not reported)
compiles every program the runs need into the persistent compile cache, so the reported
runs load them from there. Per mode, this script runs a router in this process (it only
relays) and starts one prefill and two decode workers (`python -m jaxpd.launch`, the
built-in model unless --model, KV over --kv_transport: the JAX transfer server by
default, or the gRPC stream). N greedy streams are submitted; once every one has
`--drain_after` tokens, the decode worker holding most of them gets SIGTERM. In
`migrate` mode it moves each running request to the other decode worker and exits; in
`reprefill` mode (`--nomigrate_on_drain --shutdown_timeout_s 0`) its streams are cut and the
router has each request prefilled again (prompt + output so far) for the other.

With `--drained_processes 2` the first decode worker is a role whose `decode=2` mesh
spans two processes (a leader and a follower, `--num_processes`), and it is the one
drained, whatever it holds; the other decode worker stays `decode=1`.

Reported per mode: requests moved off the drained worker; their stall (the longest gap
between two tokens of a moved request after the signal) p50 and max, next to the
inter-token gap p50 of the requests that did not move; the extra latency per moved
request (stall minus that gap); prompt tokens the prefill worker computed because of
the drain (its `prefill_tokens` after the signal); the router's counts (migrations,
fallbacks, failovers); whether every stream got the same tokens in both modes. A table
is printed and everything is saved as JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxpd.bench.workers import LaunchedWorker  # noqa: E402
from jaxpd.default_model import default_model_dir  # noqa: E402
from jaxpd.sampling_params import SamplingParams  # noqa: E402
from jaxpd.serving.role_rpc import RoleClient  # noqa: E402
from jaxpd.serving.router import Router  # noqa: E402
from jaxpd.serving.router_config import RouterConfig  # noqa: E402


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(mode: str, args, prompts: list[list[int]]) -> dict:
    model = args.model or default_model_dir()
    router = Router(model, RouterConfig(max_model_len=args.max_model_len, heartbeat_s=0.5,
                                        prefix_routing=False, stall_timeout_s=30.0,
                                        lease_s=30.0))
    internal = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
    common = ["--model", model, "--port", "0", "--host", "127.0.0.1", "--http_port", "-1",
              "--router", internal, "--kv_transport", args.kv_transport, "--max_model_len",
              str(args.max_model_len), "--heartbeat_s", "0.5"] + \
        ([] if args.warmup else ["--nowarmup"]) + \
        args.worker_args.split()
    drain = (["--migrate_on_drain", "--shutdown_timeout_s", "60"] if mode.endswith("migrate")
             else ["--nomigrate_on_drain", "--shutdown_timeout_s", "0"])
    workers = [LaunchedWorker(["--role", "prefill", "--mesh", "prefill=1"] + common)]
    decode = ["--role", "decode", "--slots_per_shard", str(args.streams)] + common + drain
    if args.drained_processes > 1:     # the role spanning processes: leader, then followers
        n = args.drained_processes
        group = decode + ["--mesh", f"decode={n}", "--num_processes", str(n),
                          "--coordinator", f"127.0.0.1:{_free_port()}"]
        workers += [LaunchedWorker(group + ["--process_id", str(i)]) for i in range(n)]
    else:
        workers.append(LaunchedWorker(decode + ["--mesh", "decode=1"]))
    workers.append(LaunchedWorker(decode + ["--mesh", "decode=1"]))
    try:
        addresses = [w.address() for w in workers]
        servers = [w for w, a in zip(workers, addresses) if a is not None]
        addresses = [a for a in addresses if a is not None]
        _until(lambda: len(router.live_workers()) == 3, 120, "workers did not join")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        requests = [router.submit(router.make_request(prompt_token_ids=p, sampling_params=params))
                    for p in prompts]
        _until(lambda: all(len(r.output_ids) >= args.drain_after for r in requests), 600,
               "streams did not start")
        prefill = RoleClient(addresses[0])
        before = prefill.info(10)["counters"]["prefill_tokens"]
        on = {a: [r for r in requests if any(c.worker.address == a
                                            for c in router.workers.calls_of(r.request_id))]
              for a in addresses[1:]}
        drained = addresses[1] if args.drained_processes > 1 else \
            max(on, key=lambda a: len(on[a]))
        moved = [r for r in on[drained] if not r.is_final]
        import logging
        logging.info("%s: SIGTERM to decode worker %s, %d of its requests streaming", mode,
                     drained, len(moved))
        signalled = time.perf_counter()
        servers[1 + addresses[1:].index(drained)].proc.send_signal(signal.SIGTERM)
        outs = [router._wait(r) for r in requests]
        after = prefill.info(10)["counters"]["prefill_tokens"]
        prefill.close()

        def gaps(r, since=0.0):
            t = [x for x in r.timings.token_times]
            return [b - a for a, b in zip(t, t[1:]) if b >= since]
        stalls = [max(gaps(r, signalled)) for r in moved]
        stayed = [g for r in requests if r not in moved for g in gaps(r)]
        itl = statistics.median(stayed) if stayed else 0.0
        counts = router.counters.snapshot()
        return {
            "mode": mode, "streams": len(requests), "moved": len(moved),
            "stall_p50_ms": 1e3 * statistics.median(stalls) if stalls else None,
            "stall_max_ms": 1e3 * max(stalls) if stalls else None,
            "itl_p50_ms": 1e3 * itl,
            "extra_latency_p50_ms": 1e3 * (statistics.median(stalls) - itl) if stalls else None,
            "prefill_tokens_after_drain": after - before,
            "migrations": counts["migrations"], "migration_fallbacks": counts["migration_fallbacks"],
            "decode_failovers": counts["decode_failovers"], "aborted": counts["aborted"],
            "finish": sorted({o.finish_reason for o in outs}),
            "tokens": [o.token_ids for o in outs],
        }
    finally:
        router.shutdown()
        for w in workers:
            w.close()
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            names = ["prefill"] + [f"decode{i}" for i in range(len(workers) - 1)]
            for name, w in zip(names, workers):
                with open(os.path.join(args.log_dir, f"{mode}-{name}.log"), "w") as f:
                    f.writelines(w.lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=384)
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--drain_after", type=int, default=16,
                   help="tokens every stream has before the drain")
    p.add_argument("--max_model_len", type=int, default=640)
    p.add_argument("--kv_transport", default="transfer_server",
                   choices=("transfer_server", "grpc"))
    p.add_argument("--modes", default="warm_reprefill,warm_migrate,reprefill,migrate",
                   help="'warm_<mode>': a run left out of the report, which fills the "
                   "persistent compile cache (workers start with --nowarmup)")
    p.add_argument("--worker_args", default="",
                   help="more flags for every worker, e.g. '--noenable_prefix_caching'")
    p.add_argument("--drained_processes", type=int, default=1,
                   help="processes of the drained decode worker's mesh (decode=N over N)")
    p.add_argument("--out", default="migration_bench.json")
    p.add_argument("--log_dir", default=None, help="keep each worker's output here")
    p.add_argument("--warmup", action="store_true",
                   help="workers warm up (compile every program) before they serve; then "
                   "pass --modes reprefill,migrate")
    args = p.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.prompt_len)]
               for _ in range(args.streams)]
    runs = [run_mode(m, args, prompts) for m in args.modes.split(",")]
    runs = [r for r in runs if not r["mode"].startswith("warm")]
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    cols = ["mode", "moved", "stall_p50_ms", "stall_max_ms", "itl_p50_ms",
            "extra_latency_p50_ms", "prefill_tokens_after_drain", "migrations",
            "migration_fallbacks", "decode_failovers", "aborted"]
    print(" | ".join(cols))
    for r in runs:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    print(f"same tokens in every mode: {same}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "same_tokens": same,
                   "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
