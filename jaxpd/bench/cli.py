"""`python -m jaxpd.bench`: serving benchmarks of disaggregated vs colocated (vs transformers).

    python -m jaxpd.bench --mesh prefill=4,decode=4 --compare colocated=8,hf \\
        --rates 0.5,1,2 --num_requests 32 --prompt_lens 64:3,512:4 --output_lens 128 \\
        --slo_ttft 1.0 --slo_tpot 0.1 --json out.json --plot out.png
    python -m jaxpd.bench --roofline [--json roofline.json]

Every backend serves the same requests (`make_workload` from `--seed`, prompt ids drawn
from the same seed; or a `--dataset` of bench/datasets.py: uniform length ranges, the
long-prompt mix, ShareGPT) with Poisson arrivals honoured on the wall clock; each rate of
a sweep sends prompts of its own (`Benchmark.draw`), so no cache serves one rate from
another. The meshes run one after the other in this one process, each engine built,
compiled (warmup=True) and fed a few warm-up requests before its clock starts; `hf` is
Hugging Face transformers `generate` with static batching on the same weights (hf.py).
Per run: TTFT, TPOT (first token excluded), ITL, E2E at mean/p50/p90/p99, output
tokens/s, requests/s, SLO attainment and, with `--goodput`, the goodput found by
bisection over the rate (the workload re-run at each probed rate).

Flags are parsed before jax is touched: on CPU the number of virtual devices
(`--xla_force_host_platform_device_count`) must be set before jax starts its backend.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
from typing import Callable, Sequence

from jaxpd.bench.args import (BASELINES, HF, LLAMA_CPP, LLAMA_CPP_BATCHED,  # noqa: F401
                              VLLM_ALIASES, add_deployment_flags,
                              add_hyphen_spellings, add_workload_flags,
                              backends_of, compare_flag, describe_devices, mesh_flag,
                              meshes_of, nonnegative_int, num_devices_needed, positive_float,
                              positive_int, resolve_model, run_mesh, whole_numbers)
from jaxpd.bench.elastic import add_elastic_flags, format_decisions
from jaxpd.bench.host import host_line
from jaxpd.bench.driver import (Backend, BenchRequest, EngineBackend, Progress, RunResult,
                                ensure_cpu_devices, make_bench_requests)
from jaxpd.bench.roofline import add_roofline_flags
from jaxpd.bench.shift import format_phase_table, phase_reports
from jaxpd.bench import datasets
from jaxpd.bench.workload import (make_shift_workload, make_workload, parse_length_mix,
                                  parse_phases, poisson_arrivals, random_streams)
from jaxpd.config import ATTENTION_IMPLS, QUANT_ACTIVATIONS, EngineConfig
from jaxpd.models.source import QUANTIZATIONS
from jaxpd.metrics import find_goodput, format_table, run_report, slo_attainment
from jaxpd.sharding.spec import AUTO, auto_mesh


# ---- flags --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The bench's flags; every one has a documented default (shown by --help)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxpd.bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every --foo_bar flag is also --foo-bar; vLLM's bench serve names work "
               "too: " + ", ".join(f"{a} ({flag})" for flag, names in VLLM_ALIASES.items()
                                   for a in names) + ".")
    add_workload_flags(p)
    _add_backend_flags(p)
    _add_output_flags(p)
    add_roofline_flags(p)
    add_hyphen_spellings(p, VLLM_ALIASES)
    return p


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("what runs")
    s.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in default model)")
    s.add_argument("--mesh", type=mesh_flag, default=AUTO,
                   help="the engine mesh under test")
    s.add_argument("--compare", type=compare_flag, default=["colocated=8"],
                   help="comma-separated baselines run on the same requests: meshes "
                        "(colocated=N, colocated=N:chunked=T with chunked prefill of T "
                        "tokens per step, prefill=P,decode=D) and/or 'hf' (transformers), "
                        "'llama_cpp' (llama-cpp-python on a GGUF --model, one sequence at a "
                        "time), 'llama_cpp_batched' (the same, every running sequence in "
                        "one llama_batch per step, as its server batches, with as many "
                        "sequences as the mesh has decode slots); 'none' for none")
    add_deployment_flags(s)
    s.add_argument("--handoff_wait_ms", type=float, default=None,
                   help="engine handoff_wait_ms (the prefill side's wait for the transfer "
                        "server's pulls before its next batch; default: the engine's)")
    s.add_argument("--max_model_len", type=positive_int, default=None,
                   help="engine max_model_len (default: longest prompt + longest output)")
    s.add_argument("--slots_per_shard", type=positive_int,
                   default=EngineConfig.slots_per_shard,
                   help="engine decode slots per dp shard (default: the engine's)")
    s.add_argument("--decode_slots", type=positive_int, default=None,
                   help="total decode slots of every engine, split evenly over its dp shards "
                        "(overrides --slots_per_shard; makes meshes with different dp compare "
                        "at equal batch capacity)")
    s.add_argument("--max_prefill_batch", type=positive_int, default=8,
                   help="engine prompts per prefill batch")
    s.add_argument("--attention_impl", default="auto", choices=ATTENTION_IMPLS,
                   help="engine decode attention core")
    s.add_argument("--quantization", default=EngineConfig.quantization, choices=QUANTIZATIONS,
                   help="engine weights: float, int8 made at load, or 'auto' (a GGUF "
                        "file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K blocks kept)")
    s.add_argument("--quant_activations", default=EngineConfig.quant_activations,
                   choices=QUANT_ACTIVATIONS,
                   help="engine activations of the native product of quantized weights: "
                        "float, or int8 blocks multiplied in integers (then a CPU prefill "
                        "mesh keeps the blocks too)")
    s.add_argument("--prefix_caching", default="default", choices=("default", "on", "off"),
                   help="the engines' prefix cache: each mesh's default (on beside a prefill "
                        "mesh in one process), or on / off for all (the prefix workloads "
                        "compare off and on themselves)")
    add_elastic_flags(s)
    s.add_argument("--hf_batch", type=positive_int, default=None,
                   help="largest static batch of the hf baseline (default: the decode slots "
                        "of the mesh under test: equal batch capacity)")
    s.add_argument("--warmup_requests", type=nonnegative_int, default=2,
                   help="requests served by each backend before its clock starts (prefix "
                        "workloads: two warm-up chats); 0 also skips compiling ahead, so "
                        "the measured run pays for every compile (for smoke tests)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo_ttft", type=positive_float, default=1.0, help="TTFT SLO, seconds")
    m.add_argument("--slo_tpot", type=positive_float, default=0.1, help="TPOT SLO, seconds")
    m.add_argument("--goodput", action="store_true",
                   help="also find each backend's goodput by bisection over the rate")
    m.add_argument("--goodput_min_rate", type=positive_float, default=0.1,
                   help="lowest rate the goodput search probes, requests/s")
    m.add_argument("--goodput_max_rate", type=positive_float, default=None,
                   help="highest rate the goodput search probes (default: 4 x the largest rate)")
    m.add_argument("--goodput_max_iters", type=nonnegative_int, default=4,
                   help="bisection steps of the goodput search (plus its two end probes)")
    m.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    m.add_argument("--plot", default=None, metavar="PATH.png",
                   help="write TTFT/ITL CDFs (and attainment vs rate) here; needs matplotlib")
    m.add_argument("--no_progress", action="store_true", help="no progress bar on stderr")
    m.add_argument("--single_stream", type=nonnegative_int, default=0,
                   help="before the workload, each backend also serves this many of its "
                        "requests one at a time, alone: their median TPOT is reported "
                        "as 'batch-1 TPOT' (a single conversation's speed)")


def check_meshes(args: argparse.Namespace, error: Callable[[str], object]) -> None:
    """The meshes against each other and `--decode_slots`; "auto" is checked once it is
    resolved (`main`, after jax has come up)."""
    from jaxpd.sharding.spec import parse_mesh_spec
    if args.mesh in args.compare:
        error(f"--compare: {args.mesh} is already the --mesh under test")
    if args.decode_slots is not None:
        for mesh in meshes_of(args) + ([args.process_mesh] if args.processes else []):
            dp = 1 if mesh == AUTO else parse_mesh_spec(run_mesh(mesh)[0]).decode_dp
            if args.decode_slots % dp:
                error(f"--decode_slots={args.decode_slots} does not split evenly over "
                      f"the {dp} decode shards of {mesh}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check flags; exits with a message naming the flag on error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.rates = args.rates or [args.rate]
    args.phase_list = None
    if args.workload == "shift":
        try:
            args.phase_list = parse_phases(args.phases)
        except ValueError as e:
            parser.error(f"--phases: {e}")
        args.num_requests = sum(p.num_requests for p in args.phase_list)
    args.processes = None
    if args.deployment == "processes":
        from jaxpd.bench.processes import make_deployment
        try:
            args.processes = make_deployment(args.process_mesh, args.prefill_cpus,
                                             args.decode_cpus,
                                             kv_transport=args.process_kv_transport)
        except ValueError as e:
            parser.error(str(e))
    elif args.prefill_cpus is not None or args.decode_cpus is not None:
        parser.error("--prefill_cpus/--decode_cpus need --deployment processes")
    check_meshes(args, parser.error)
    if args.dataset != "mix" and args.workload != "poisson":
        parser.error(f"--dataset {args.dataset}: only with --workload poisson")
    if args.prefix_caching != "default" and args.workload not in ("poisson", "shift"):
        parser.error(f"--prefix_caching: --workload {args.workload} runs every mesh with the "
                     f"cache off and on already")
    if (args.kv_host_cache_gb > 0 or args.prefill_host_cache_gb > 0 or
            args.pages_per_shard is not None) and args.workload in ("poisson", "shift"):
        parser.error("--kv_host_cache_gb/--prefill_host_cache_gb/--pages_per_shard: only with "
                     "--workload multiturn or prefix_repetition")
    if args.goodput_max_rate is not None and args.goodput_max_rate < args.goodput_min_rate:
        parser.error(f"--goodput_max_rate={args.goodput_max_rate} is below "
                     f"--goodput_min_rate={args.goodput_min_rate}")
    for name in ("roofline_batches", "roofline_contexts"):
        setattr(args, name, whole_numbers(parser, name, getattr(args, name)))
    return args


# ---- running ------------------------------------------------------------------------

def _run_name(backend: str, rate: float, args: argparse.Namespace) -> str:
    return backend if len(args.rates) == 1 else f"{backend}@{rate:g}/s"


class Benchmark:
    """Runs every backend over the workload at every rate and collects reports."""

    def __init__(self, args: argparse.Namespace, model_dir: str):
        from jaxpd.models.source import model_config_and_tokenizer
        self.args, self.model_dir = args, model_dir
        cfg, tokenizer = model_config_and_tokenizer(model_dir)
        self.vocab_size = cfg.vocab_size
        self.sharegpt: list[tuple[tuple[int, ...], int]] | None = None
        self.draws: dict[float | str, int] = {}     # a run's key -> its draw of prompts
        if args.dataset == "mix":
            prompts, outputs = self.prompt_lens(), [
                n for mix in self._mixes("output_lens") for n, _ in parse_length_mix(mix)]
            self.max_model_len = args.max_model_len or max(prompts) + max(outputs)
            flags = "--prompt_lens/--output_lens"
        else:
            # What a request may span: fixed before sampling, so every rate draws the same.
            self.dataset_max_len = min(args.max_model_len or cfg.max_position_embeddings,
                                       cfg.max_position_embeddings)
            try:
                sampled = self._sample_dataset(self.dataset_max_len, tokenizer)
            except ValueError as e:
                raise SystemExit(
                    f"--dataset {args.dataset}: {e} (the lower of --max_model_len and the "
                    f"model's max_position_embeddings={cfg.max_position_embeddings})") from None
            prompts = [len(r.prompt_ids) for r in sampled]
            outputs = [r.output_len for r in sampled]
            self.max_model_len = args.max_model_len or max(
                len(r.prompt_ids) + r.output_len for r in sampled)
            flags = f"--dataset {args.dataset}"
        if self.max_model_len > cfg.max_position_embeddings:
            raise SystemExit(f"{flags}: the longest request needs "
                             f"{self.max_model_len} positions, the model has "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.warm_prompt_lens = prompts if args.dataset == "mix" else _spread(prompts)
        self.engine_options = dict(max_model_len=self.max_model_len,
                                   slots_per_shard=args.slots_per_shard,
                                   max_prefill_batch=args.max_prefill_batch,
                                   attention_impl=args.attention_impl,
                                   quantization=args.quantization,
                                   quant_activations=args.quant_activations)
        if args.handoff_wait_ms is not None:
            self.engine_options["handoff_wait_ms"] = args.handoff_wait_ms
        if args.prefix_caching != "default":
            self.engine_options["enable_prefix_caching"] = args.prefix_caching == "on"
        self.warmup = self._warmup_requests(min(prompts), max(prompts), min(max(outputs), 8))
        self.reports: list[dict] = []
        self.timelines: dict[str, list] = {}

    def _warmup_requests(self, shortest: int, longest: int,
                         output_len: int) -> list[BenchRequest]:
        """`--warmup_requests` requests alternating the shortest and the longest prompt
        of the mix: both prefill paths get exercised."""
        a = self.args
        warm = []
        for prompt_len, seed in ((shortest, a.seed + 1), (longest, a.seed + 2)):
            workload = make_workload(1, 1.0, [(prompt_len, 1)], [(output_len, 1)], seed)
            warm += make_bench_requests(workload, self.vocab_size, seed)
        return (warm * a.warmup_requests)[:a.warmup_requests]

    def _sample_dataset(self, max_model_len: int, tokenizer) -> list[BenchRequest]:
        """The `--dataset` requests at rate 1, checked against `max_model_len` (the
        engine's, or the model's positions); ValueError when they cannot fit. ShareGPT's
        pairs are sampled here, once: `num_requests` for each draw (`draw`), a rate
        re-times its own."""
        a = self.args
        flag = f"--dataset {a.dataset}"
        if a.dataset == "sharegpt":
            if tokenizer is None:
                raise SystemExit(f"{flag}: the model {self.model_dir} has no tokenizer")
            with datasets.sharegpt_file() as path:
                conversations = datasets.read_conversations(str(path))
            self.sharegpt = datasets.sample_sharegpt(
                conversations, tokenizer.encode, a.num_requests * self.num_draws(), a.seed,
                max_model_len, a.sharegpt_max_prompt_len, a.sharegpt_max_total_len)
        elif a.dataset == "random":
            if a.input_len.hi + a.output_len.hi > max_model_len:
                raise ValueError(f"--input_len/--output_len: the longest request needs "
                                 f"{a.input_len.hi + a.output_len.hi} positions, a request "
                                 f"may span only {max_model_len}")
        else:
            datasets.long_mix_ranges(a.output_len, max_model_len)   # ValueError: no fit
        return [r for d in range(self.num_draws()) for r in self.requests(1.0, d)]

    def _mixes(self, name: str) -> list[str]:
        """The `prompt_lens` or `output_lens` mixes of the workload (one per phase)."""
        if self.args.phase_list is None:
            return [getattr(self.args, name)]
        return [getattr(p, name) for p in self.args.phase_list]

    def prompt_lens(self) -> list[int]:
        return [n for mix in self._mixes("prompt_lens") for n, _ in parse_length_mix(mix)]

    def num_draws(self) -> int:
        """Draws of prompts a sweep needs: one per rate, and one for `--single_stream`."""
        return len(self.args.rates) + (1 if self.args.single_stream else 0)

    def draw(self, key: float | str) -> int:
        """The draw of prompts of the run `key` (a rate, or "single"): numbered in the
        order first asked, the same for every backend. Goodput's probe rates past
        `num_draws` share ShareGPT's draws in turn (its pairs are sampled once)."""
        return self.draws.setdefault(key, len(self.draws))

    def requests_at(self, rate: float) -> list[BenchRequest]:
        """The measured workload at `rate`: the same lengths and arrivals at every rate,
        re-timed, with the prompts of the rate's own draw."""
        return self.requests(rate, self.draw(rate))

    def requests(self, rate: float, draw: int) -> list[BenchRequest]:
        """The workload's requests at `rate`, with the prompts of draw `draw`."""
        a = self.args
        if self.sharegpt is not None:
            n = a.num_requests
            first = (draw % self.num_draws()) * n
            pairs = self.sharegpt[first:first + n]
            arrivals = poisson_arrivals(random_streams(a.seed)[0], n, rate)
            return [BenchRequest(i, float(arrivals[i]), ids, output_len)
                    for i, (ids, output_len) in enumerate(pairs)]
        if a.dataset in ("random", "long_mix"):
            ranges = ([(a.input_len, 1.0)] if a.dataset == "random" else
                      datasets.long_mix_ranges(a.output_len, self.dataset_max_len))
            workload = datasets.make_range_workload(a.num_requests, rate, ranges,
                                                    a.output_len, a.seed)
        elif a.phase_list is not None:
            workload = make_shift_workload(a.phase_list, rate, a.seed)
        else:
            workload = make_workload(a.num_requests, rate, a.prompt_lens, a.output_lens, a.seed)
        return make_bench_requests(workload, self.vocab_size, a.seed, draw)

    def open(self, name: str) -> Backend:
        """Build and warm up backend `name` (a mesh, or `hf`)."""
        if name == LLAMA_CPP:
            from jaxpd.bench.llama_cpp import LlamaCppBackend
            return LlamaCppBackend(self.model_dir, n_ctx=max(512, self.max_model_len),
                                   warmup_requests=self.warmup)
        if name == LLAMA_CPP_BATCHED:
            from jaxpd.bench.llama_cpp import LlamaCppBatchedBackend
            # Equal batch capacity: as many sequences as the mesh under test has slots.
            return LlamaCppBatchedBackend(self.model_dir, self.decode_slots(),
                                          n_ctx=max(512, self.max_model_len),
                                          warmup_requests=self.warmup)
        if name == HF:
            from jaxpd.bench.hf import HFBackend
            return HFBackend(self.model_dir, self.args.hf_batch or self.decode_slots(),
                             self.warmup)
        prompt_lens = self.warm_prompt_lens
        deployment = self.args.processes
        if deployment is not None and name == deployment.name:
            from jaxpd.bench.processes import ProcessesBackend
            return ProcessesBackend(self.model_dir, deployment,
                                    self.options_for(self.args.process_mesh), self.warmup,
                                    prompt_lens, compile_ahead=bool(self.warmup))
        from jaxpd.sharding.spec import parse_mesh_spec
        if parse_mesh_spec(run_mesh(name)[0]).elastic:
            from jaxpd.bench.elastic import ElasticBackend
            a = self.args
            return ElasticBackend(self.model_dir, name, self.options_for(name), self.warmup,
                                  prompt_lens, bool(self.warmup), slo_ttft_s=a.slo_ttft,
                                  slo_tpot_s=a.slo_tpot, interval_s=a.elastic_interval_s,
                                  sustain_s=a.elastic_sustain_s, dwell_s=a.elastic_dwell_s,
                                  step=a.elastic_step)
        mesh, options = run_mesh(name)
        return EngineBackend(self.model_dir, mesh, {**self.options_for(mesh), **options},
                             self.warmup, prompt_lens, compile_ahead=bool(self.warmup),
                             name=name)

    def decode_slots(self) -> int:
        """Decode slots of the mesh under test (what `hf`'s batch matches by default)."""
        from jaxpd.sharding.spec import parse_mesh_spec
        if self.args.decode_slots:
            return self.args.decode_slots
        mesh = parse_mesh_spec(self.args.mesh)
        return self.args.slots_per_shard * max(1, mesh.decode_dp)

    def options_for(self, mesh: str) -> dict:
        """Engine options of one mesh: `--decode_slots` becomes slots per dp shard."""
        from jaxpd.sharding.spec import parse_mesh_spec
        options = dict(self.engine_options)
        if self.args.decode_slots:
            dp = parse_mesh_spec(mesh).decode_dp
            options["slots_per_shard"] = max(1, self.args.decode_slots // dp)
        return options

    def run_once(self, backend: Backend, rate: float, label: str) -> RunResult:
        progress = Progress(self.args.num_requests, label, not self.args.no_progress)
        try:
            return backend.run(self.requests_at(rate), progress.update)
        finally:
            progress.close()

    def run_backend(self, name: str) -> None:
        """Serve the workload on backend `name` at every rate (and goodput probes); add
        one report per rate."""
        _log(f"[{name}] building and warming up")
        backend = self.open(name)
        try:
            single = self.single_stream(backend) if self.args.single_stream else None
            measured = {rate: self.run_once(backend, rate, f"{name} @ {rate:g} req/s")
                        for rate in self.args.rates}
            goodput = self.search_goodput(backend, name, measured) if self.args.goodput else None
        finally:
            backend.close()
            # Its engine sits in reference cycles: free its pools before the next backend
            # builds its own, or both are held at once.
            del backend
            gc.collect()
        for rate in self.args.rates:
            self.add_report(name, rate, measured, goodput)
            if single is not None:
                self.reports[-1]["single_stream_tpot_s"] = single

    def single_stream(self, backend: Backend) -> float | None:
        """Median TPOT of `--single_stream` of the workload's requests, each served
        alone (arriving at 0 on its own run)."""
        from jaxpd.metrics import tpot
        tpots = []
        alone_draw = self.requests(self.args.rates[0], self.draw("single"))
        for r in alone_draw[:self.args.single_stream]:
            alone = BenchRequest(0, 0.0, r.prompt_ids, r.output_len)
            value = tpot(backend.run([alone]).timelines[0].token_times_s)
            if value is not None:
                tpots.append(value)
        return statistics.median(tpots) if tpots else None

    def search_goodput(self, backend: Backend, name: str,
                       measured: dict[float, RunResult]) -> float | None:
        """Bisect over the rate for the goodput; every probe's run lands in `measured`."""
        a = self.args

        def attainment(rate: float) -> float:
            if rate not in measured:
                measured[rate] = self.run_once(backend, rate,
                                               f"{name} goodput probe @ {rate:.3g} req/s")
            return slo_attainment(measured[rate].timelines, a.slo_ttft, a.slo_tpot)

        hi = a.goodput_max_rate or 4 * max(a.rates)
        return find_goodput(attainment, min(a.goodput_min_rate, hi), hi,
                            max_iters=a.goodput_max_iters)

    def add_report(self, name: str, rate: float, measured: dict[float, RunResult],
                   goodput: float | None) -> None:
        """The report of backend `name` at `rate`, with its timelines kept for plotting."""
        a = self.args
        result = measured[rate]
        run_name = _run_name(name, rate, a)
        report = run_report(run_name, result.timelines, result.duration_s, a.slo_ttft,
                            a.slo_tpot, goodput)
        gaps = [gap for t in result.timelines for gap in t.itls]
        # The worst gap: a few prefill stalls hide below p99 in a short run.
        report.update(backend=name, rate=rate, num_aborted=result.num_aborted,
                      itl_max_s=max(gaps) if gaps else None, engine_stats=result.stats)
        if name not in BASELINES:
            deployment = a.processes
            report["engine_options"] = self.options_for(
                a.process_mesh if deployment and name == deployment.name else name)
        if a.phase_list is not None:
            report["phases"] = phase_reports(result.timelines, a.phase_list, a.slo_ttft,
                                             a.slo_tpot)
        if a.goodput:
            report["goodput_probes"] = {
                f"{r:.6g}": slo_attainment(m.timelines, a.slo_ttft, a.slo_tpot)
                for r, m in sorted(measured.items())}
        self.reports.append(report)
        self.timelines[run_name] = result.timelines

    def results(self) -> dict:
        """The JSON document: runs, workload, devices."""
        a = self.args
        return {
            "runs": self.reports,
            "workload": {"num_requests": a.num_requests, "rates": a.rates,
                         "dataset": a.dataset,
                         "input_len": str(a.input_len) if a.dataset == "random" else None,
                         "output_len": (str(a.output_len) if a.dataset in ("random", "long_mix")
                                        else None),
                         "prompt_lens": a.prompt_lens, "output_lens": a.output_lens,
                         "seed": a.seed, "slo_ttft_s": a.slo_ttft, "slo_tpot_s": a.slo_tpot,
                         "phases": ([dataclasses.asdict(p) for p in a.phase_list]
                                    if a.phase_list is not None else None),
                         "model": self.model_dir, "max_model_len": self.max_model_len,
                         "engine_options": self.engine_options,
                         "deployment": dataclasses.asdict(a.processes) if a.processes else None},
            "devices": describe_devices(),
        }


def _spread(lengths: Sequence[int]) -> list[int]:
    """The longest length of each power-of-two range in `lengths`: prefill shapes to
    compile and warm ahead. A dataset has hundreds of distinct lengths and warming each
    would take minutes; prefill buckets are coarser than this."""
    longest: dict[int, int] = {}
    for n in lengths:
        longest[n.bit_length()] = max(n, longest.get(n.bit_length(), 0))
    return sorted(set(longest.values()) | {min(lengths)})


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark the flags describe; returns the JSON document it wrote/printed."""
    args = parse_args(argv)
    if args.plot:
        from jaxpd.bench.plot import require_matplotlib
        require_matplotlib()   # fail before minutes of benchmarking, not after
    if args.roofline:
        from jaxpd.bench.roofline import run_roofline
        model_dir = resolve_model(args.model)
        return run_roofline(model_dir, args)
    ensure_cpu_devices(num_devices_needed(args))
    if args.mesh == AUTO:
        import jax
        args.mesh = auto_mesh(jax.devices()[0].platform, jax.device_count())
        check_meshes(args, lambda message: sys.exit(f"--mesh auto is {args.mesh}: {message}"))
    model_dir = resolve_model(args.model)
    if args.workload not in ("poisson", "shift"):
        from jaxpd.bench.prefix import run_prefix_bench
        pool = {} if args.pages_per_shard is None else {"pages_per_shard": args.pages_per_shard}
        results = run_prefix_bench(args, model_dir, meshes_of(args), dict(
            slots_per_shard=args.slots_per_shard, max_prefill_batch=args.max_prefill_batch,
            prefix_extend_below=args.prefix_extend_below, attention_impl=args.attention_impl,
            **pool))
        _write_outputs(argparse.Namespace(**{**vars(args), "plot": None}), results, {})
        return results
    bench = Benchmark(args, model_dir)
    for name in backends_of(args):
        bench.run_backend(name)
    results = bench.results()
    _print_runs(results["runs"], results["devices"])
    _write_outputs(args, results, bench.timelines)
    return results


def _print_runs(runs: list[dict], devices: dict) -> None:
    print(host_line(devices["host"]))
    print(format_table(runs))
    if any("single_stream_tpot_s" in r for r in runs):
        print("batch-1 TPOT (ms): " + "  ".join(
            f"{r['name']}={r['single_stream_tpot_s'] * 1e3:.1f}" for r in runs
            if r.get("single_stream_tpot_s") is not None))
    print("ITL max (ms):       " + "  ".join(
        f"{r['name']}={r['itl_max_s'] * 1e3:.1f}" for r in runs if r["itl_max_s"] is not None))
    if runs and "phases" in runs[0]:
        print(format_phase_table(runs))
    decisions = format_decisions(runs)
    if decisions:
        print("elastic moves:\n" + decisions)


def _write_outputs(args: argparse.Namespace, results: dict, timelines: dict[str, list]) -> None:
    """The --json document and the --plot figure, where asked for."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        from jaxpd.bench.plot import plot_runs
        plot_runs(timelines, results["runs"], args.plot)


if __name__ == "__main__":
    main()
