"""`python -m jaxpd.bench.kv_offers`: how a prefill role spanning processes hands its KV
over -- each process offering its own kv-head shards (`--kv_offers shards`, the
default) or the leader gathering and sending it all (`gather`) -- on the same
requests, side by side.

For each mode it starts a router (in this process), a prefill role of
`--prefill_processes` processes forming `--prefill_mesh` (`engine.multihost`) and a
decode worker, warms them up, serves the same Poisson requests, and prints TTFT, the
first -> second token gap (it holds the handoff), KV bytes moved and pieces pulled;
`--json` saves them. Needs a model whose kv heads divide the prefill mesh's tp for
there to be shards (the built-in model: 4 kv heads).
"""
from __future__ import annotations

import argparse
import json

from jaxpd.bench.host import describe_host, host_line
from jaxpd.bench.driver import make_bench_requests
from jaxpd.bench.prefix import worker_counters
from jaxpd.bench.processes import Deployment, ProcessesBackend, make_deployment
from jaxpd.bench.workload import make_workload
from jaxpd.metrics import run_report

MODES = ("shards", "gather")


def serve(model_dir: str, deployment: Deployment, requests, options: dict) -> dict:
    """One mode's run: a fresh deployment, warmed on the run's shapes, then timed."""
    lens = sorted({len(r.prompt_ids) for r in requests})
    backend = ProcessesBackend(model_dir, deployment, options, warmup_requests=requests[:4],
                               warm_prompt_lens=lens)
    try:
        before = worker_counters(backend.front)
        result = backend.run(requests)
        after = worker_counters(backend.front)
    finally:
        backend.close()
    report = run_report(deployment.kv_offers, result.timelines, result.duration_s, 1e9, 1e9)
    report.update(aborted=result.num_aborted, **{name: after[name] - before[name] for name in (
        "transfers", "transfer_bytes", "kv_pieces_pulled")})
    return report


def format_runs(runs: list[dict]) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f}"
    rows = [f"{'kv offers':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'gap p50':>9}{'gap p99':>9}"
            f"{'E2E p50':>9}{'req/s':>7}{'aborted':>9}{'KV MB':>8}{'pieces':>8}  (ms)"]
    for r in runs:
        rows.append(f"{r['name']:<10}{ms(r['ttft_s']['p50']):>10}{ms(r['ttft_s']['p99']):>10}"
                    f"{ms(r['handoff_gap_s']['p50']):>9}{ms(r['handoff_gap_s']['p99']):>9}"
                    f"{ms(r['e2e_s']['p50']):>9}{r['req_s']:>7.2f}{r['aborted']:>9}"
                    f"{r['transfer_bytes'] / 2**20:>8.1f}{r['kv_pieces_pulled']:>8}")
    return "\n".join(rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m jaxpd.bench.kv_offers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in)")
    p.add_argument("--prefill_mesh", default="prefill=4")
    p.add_argument("--prefill_processes", type=int, default=2)
    p.add_argument("--decode_mesh", default="decode=1")
    p.add_argument("--num_requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--prompt_lens", default="512", help="length[:weight],... as the bench's")
    p.add_argument("--output_lens", default="8")
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES), help="which of shards,gather, in order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    from jaxpd.default_model import default_model_dir
    from jaxpd.models.source import model_config_and_tokenizer
    model_dir = a.model or str(default_model_dir())
    vocab = model_config_and_tokenizer(model_dir)[0].vocab_size
    requests = make_bench_requests(make_workload(a.num_requests, a.rate, a.prompt_lens,
                                                 a.output_lens, a.seed), vocab, a.seed)
    base = make_deployment(f"{a.prefill_mesh},{a.decode_mesh}", None, None)
    runs = []
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
        deployment = Deployment(base.prefill_mesh, base.decode_mesh, base.prefill_cpus,
                                base.decode_cpus, prefill_processes=a.prefill_processes,
                                kv_offers=mode)
        print(f"serving {len(requests)} requests through {deployment.name}", flush=True)
        runs.append(serve(model_dir, deployment, requests,
                          {"max_model_len": a.max_model_len}))
    print(host_line(describe_host()))
    print(format_runs(runs))
    result = {"args": vars(a), "runs": runs}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
