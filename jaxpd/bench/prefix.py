"""Prefix-caching workloads (`python -m jaxpd.bench --workload multiturn|prefix_repetition`):
every mesh served twice on the same requests, prefix cache off and on.

- `multiturn`: `--conversations` chats, each of `--turns` turns. Every chat starts
  with the same `--system_len`-token system prompt; a turn's prompt is the whole
  conversation so far (its previous prompts and the model's real answers) plus a new
  `--user_len`-token message. A chat sends its next turn `--think_s` after the
  previous answer ends (closed loop); chats start at Poisson times at `--rate`.
- `prefix_repetition` (as vLLM's bench): `--num_prefixes` distinct prefixes of
  `--prefix_len` tokens, each reused by `--num_requests / --num_prefixes` requests
  that add their own `--user_len` tokens; Poisson arrivals at `--rate`.

With `--kv_host_cache_gb` above 0 each mesh also runs a third time, cache on with a
host tier of that size (evicted pages kept in host memory and restored); with
`--pages_per_shard` too small to hold every conversation, that is device-only against
device + host tier. `--prefill_host_cache_gb` gives the prefill mesh's own cache a host
tier too in that run (it alone when `--kv_host_cache_gb` is 0); its restored tokens
are counted apart (`prefill_host_hit_tokens`).

With `--deployment processes`, the pinned multi-process deployment (a router in this
process in front of a prefill and a decode worker, `bench/processes.py`) is served too,
cache off and on, each started afresh; its counters are its workers' (`worker_counters`).

Answers are `--output_lens`' first length, greedy, EOS ignored. Per run: TTFT and ITL
percentiles, output tokens/s, SLO attainment against `--slo_ttft`/`--slo_tpot` and the
goodput (requests that met both SLOs per second of the run: the chats' closed loop sets
the rate, so there is no rate to search), prompt tokens computed
(`prefill_computed_tokens`: padding excluded, on every prefill path), the cache's hit rate,
KV bytes moved between meshes and KV bytes a handoff did not carry because the decode
side held them ("not sent"); the greedy outputs of the two runs of a mesh are compared.
"""
from __future__ import annotations

import argparse
import dataclasses
import threading
import time

import numpy as np

from jaxpd.bench.host import describe_host, host_line
from jaxpd.bench.driver import FIRST_ORDINARY_ID, greedy, stats_delta, timeline_of
from jaxpd.bench.workload import parse_length_mix
from jaxpd.engine.compile.background import settle
from jaxpd.metrics import meets_slo, summarize
from jaxpd.sharding.spec import parse_mesh_spec


@dataclasses.dataclass(frozen=True)
class Chat:
    """One closed-loop client: its start time, then each turn's new tokens."""
    start_s: float
    turns: tuple[tuple[int, ...], ...]


def make_chats(args: argparse.Namespace, vocab_size: int) -> list[Chat]:
    """The workload's clients, fixed by `--seed` (the same for every run)."""
    rng = np.random.default_rng(args.seed)
    draw = lambda n: tuple(int(i) for i in rng.integers(FIRST_ORDINARY_ID, vocab_size, n))
    if args.workload == "multiturn":
        system, count = draw(args.system_len), args.conversations
        turns = [[system + draw(args.user_len)] + [draw(args.user_len)
                                                   for _ in range(args.turns - 1)]
                 for _ in range(count)]
    else:
        prefixes = [draw(args.prefix_len) for _ in range(args.num_prefixes)]
        count = args.num_requests
        turns = [[prefixes[i % args.num_prefixes] + draw(args.user_len)] for i in range(count)]
        order = rng.permutation(count)
        turns = [turns[i] for i in order]
    gaps = rng.standard_exponential(count) / args.rate
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return [Chat(float(s), tuple(t)) for s, t in zip(starts, turns)]


def worker_counters(router) -> dict:
    """A router deployment's engine counters: every live worker's, summed (prefill
    tokens are computed on both roles, cache hits and KV moved on the decode side)."""
    from jaxpd.stats import COUNTERS
    total: dict = dict.fromkeys(COUNTERS, 0)
    for workers in router.stats()["workers"].values():
        for info in workers:
            for name, value in info.get("counters", {}).items():
                total[name] = total.get(name, 0) + value
    return total


def serve(llm, chats: list[Chat], output_len: int, think_s: float, stats=None,
          slo: tuple[float, float] = (1.0, 0.1)) -> dict:
    """Run every chat (a thread each) against `llm` (an `LLM` or a `Router`); the run's
    figures and outputs. `stats`: where the engine counters come from (`llm.stats`);
    `slo`: (TTFT, TPOT) seconds for the attainment and the goodput (requests that met
    both, per second of the run)."""
    stats_of = stats or llm.stats
    before = stats_of()
    origin = time.perf_counter()
    done: list[tuple[int, int, object, list[int]]] = []
    lock = threading.Lock()

    def client(index: int, chat: Chat) -> None:
        time.sleep(max(0.0, origin + chat.start_s - time.perf_counter()))
        history: list[int] = []
        for turn, new in enumerate(chat.turns):
            history = history + list(new)
            r = llm.make_request(prompt_token_ids=history, sampling_params=greedy(output_len))
            r.timings.arrival = time.perf_counter()
            llm.submit(r)
            for _ in llm.events(r):
                pass
            with lock:
                done.append((index, turn, r, list(r.output_ids)))
            history = history + list(r.output_ids)
            time.sleep(think_s)

    threads = [threading.Thread(target=client, args=(i, c), daemon=True,
                                name=f"jaxpd-bench-chat-{i}") for i, c in enumerate(chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = stats_delta(before, stats_of())
    timelines = [timeline_of(r.timings, origin) for _, _, r, _ in done]
    duration = max(t.finish_s for t in timelines) - min(t.arrival_s for t in timelines)
    queried = stats.get("prefix_query_tokens", 0)
    met = sum(meets_slo(t, *slo) for t in timelines)
    return {
        "ttft_s": summarize(t.ttft for t in timelines if t.ttft is not None),
        "slo_attainment": met / len(timelines),
        "goodput_req_s": met / max(duration, 1e-9),
        "itl_s": summarize(x for t in timelines for x in t.itls),
        "output_tok_s": sum(t.num_tokens for t in timelines) / max(duration, 1e-9),
        "prompt_tokens": sum(len(r.prompt_ids) for _, _, r, _ in done),
        "prefill_tokens": stats["prefill_computed_tokens"],
        "hit_rate": stats.get("prefix_hit_tokens", 0) / queried if queried else 0.0,
        "host_hit_rate": stats.get("prefix_host_hit_tokens", 0) / queried if queried else 0.0,
        "host_restored_pages": stats.get("host_tier_restored_pages", 0),
        "prefill_host_hit_tokens": stats.get("prefill_cache_host_hit_tokens", 0),
        "prefill_hit_tokens": stats.get("prefill_cache_hit_tokens", 0),
        "prefill_host_restored_pages": stats.get("prefill_host_tier_restored_pages", 0),
        "host_corrupt_pages": stats.get("host_tier_corrupt_pages", 0),
        "transfer_bytes": stats["transfer_bytes"],
        "saved_bytes": stats.get("prefix_saved_bytes", 0),
        "evictions": stats.get("prefix_evictions", 0),
        # Served without their prefix (or through the prefill mesh) meanwhile: their
        # program with a prefix was still compiling in the background.
        "cold_batches": stats.get("prefill_cache_cold_batches", 0),
        "extend_cold_requests": stats.get("extend_cold_requests", 0),
        "outputs": {f"{i}.{turn}": ids for i, turn, _, ids in sorted(done, key=lambda d: d[:2])},
    }


def run_prefix_bench(args: argparse.Namespace, model_dir: str, meshes: list[str],
                     engine_options: dict) -> dict:
    """Each mesh with the cache off, then on, on the same chats; prints the table."""
    from jaxpd.llm import LLM
    from jaxpd.models.source import model_config_and_tokenizer
    cfg = model_config_and_tokenizer(model_dir)[0]
    chats = make_chats(args, cfg.vocab_size)
    output_len = parse_length_mix(args.output_lens)[0][0]
    longest = (args.system_len + args.turns * (args.user_len + output_len)
               if args.workload == "multiturn" else args.prefix_len + args.user_len + output_len)
    engine_options = {**engine_options, "max_model_len": args.max_model_len or longest}
    runs = []
    tiers = [("off", False, 0.0), ("on", True, 0.0)]
    if args.kv_host_cache_gb > 0 or args.prefill_host_cache_gb > 0:
        tiers.append(("on+host", True, args.kv_host_cache_gb))
    for mesh in meshes:
        outputs = {}
        for label, cache, host_gb in tiers:
            # --warmup_requests 0: no warm-up at all (programs compile on first use).
            warm = args.warmup_requests > 0
            options = dict(engine_options)
            if not cache:
                options.pop("prefix_extend_below", None)
            if host_gb:
                options["kv_host_cache_gb"] = host_gb
            if label == "on+host" and args.prefill_host_cache_gb > 0 and \
                    parse_mesh_spec(mesh).has_prefill and not parse_mesh_spec(mesh).colocated:
                options["prefill_host_cache_gb"] = args.prefill_host_cache_gb
            with LLM(model_dir, mesh=mesh, warmup=warm, enable_prefix_caching=cache,
                     **options) as llm:
                if warm:   # first-call paths, on other chats of the same shape
                    serve(llm, make_chats(_warm_args(args), cfg.vocab_size), output_len, 0.0)
                    settle(llm.engine)     # what they asked to compile in the background
                run = serve(llm, chats, output_len, args.think_s,
                            slo=(args.slo_ttft, args.slo_tpot))
            outputs[label] = run.pop("outputs")
            runs.append({"name": f"{mesh} cache={label}", "mesh": mesh,
                         "prefix_caching": cache, "kv_host_cache_gb": host_gb, **run})
        runs[-1]["outputs_identical"] = all(o == outputs["off"] for o in outputs.values())
    if args.processes is not None:
        runs += _serve_deployment(args, model_dir, chats, output_len, engine_options)
    host = describe_host()
    print(host_line(host))
    print(format_prefix_table(runs))
    return {"workload": args.workload, "runs": runs, "host": host}


def _serve_deployment(args: argparse.Namespace, model_dir: str, chats: list[Chat],
                      output_len: int, engine_options: dict) -> list[dict]:
    """The pinned multi-process deployment (`--deployment processes`: a router in this
    process, a prefill and a decode worker), cache off then on, each started afresh."""
    from jaxpd.bench.processes import ProcessesBackend
    from jaxpd.models.source import model_config_and_tokenizer
    vocab = model_config_and_tokenizer(model_dir)[0].vocab_size
    deployment, runs, outputs = args.processes, [], {}
    for cache in (False, True):
        options = dict(engine_options, enable_prefix_caching=cache)
        if not cache:
            options.pop("prefix_extend_below", None)
        warm = args.warmup_requests > 0
        backend = ProcessesBackend(model_dir, deployment, options, compile_ahead=warm)
        try:
            stats = lambda: worker_counters(backend.front)
            if warm:
                serve(backend.front, make_chats(_warm_args(args), vocab), output_len, 0.0, stats)
                backend.settle()
            run = serve(backend.front, chats, output_len, args.think_s, stats,
                        slo=(args.slo_ttft, args.slo_tpot))
        finally:
            backend.close()
        outputs[cache] = run.pop("outputs")
        runs.append({"name": f"{deployment.name} cache={'on' if cache else 'off'}",
                     "mesh": deployment.name, "prefix_caching": cache, "kv_host_cache_gb": 0.0,
                     **run})
    runs[-1]["outputs_identical"] = outputs[True] == outputs[False]
    return runs


def _warm_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seed": args.seed + 1000, "rate": 1e9,
                                 "conversations": min(args.conversations, 2),
                                 "num_requests": min(args.num_requests, 2 * args.num_prefixes)})


def format_prefix_table(runs: list[dict]) -> str:
    head = (f"{'run':<34}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>10}{'tok/s':>8}"
            f"{'SLO %':>7}{'goodput':>9}"
            f"{'computed':>10}{'of prompt':>11}{'hit rate':>10}{'host hit':>10}{'KV MB':>8}"
            f"{'not sent':>10}")
    rows = [head]
    for r in runs:
        ms = lambda s: f"{s * 1e3:.0f} ms" if s is not None else "-"
        rows.append(f"{r['name']:<34}{ms(r['ttft_s']['p50']):>10}{ms(r['ttft_s']['p99']):>10}"
                    f"{ms(r['itl_s']['p99']):>10}{r['output_tok_s']:>8.1f}"
                    f"{100 * r['slo_attainment']:>7.0f}{r['goodput_req_s']:>9.2f}"
                    f"{r['prefill_tokens']:>10}{r['prompt_tokens']:>11}"
                    f"{r['hit_rate']:>10.0%}{r['host_hit_rate']:>10.0%}"
                    f"{r['transfer_bytes'] / 2**20:>8.2f}"
                    f"{r['saved_bytes'] / 2**20:>10.2f}")
    for r in runs:
        if r.get("cold_batches") or r.get("extend_cold_requests"):
            rows.append(f"{r['name']}: {r['cold_batches']} prefill batches and "
                        f"{r['extend_cold_requests']} decode-mesh prefills went without "
                        f"their prefix (its program still compiling in the background)")
    for r in runs:
        if "outputs_identical" in r:
            rows.append(f"{r['mesh']}: greedy outputs identical with the cache on and off"
                        f"{' (and the host tier)' if r['kv_host_cache_gb'] else ''}: "
                        f"{r['outputs_identical']}")
    return "\n".join(rows)
