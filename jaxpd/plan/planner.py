"""`python -m jaxpd.plan`: which split of N devices serves a workload best (DistServe-style).

    python -m jaxpd.plan --num_devices 8 --rate 1 --prompt_lens 64:3,512:4 \\
        --output_lens 128 --slo_ttft 1.0 --slo_tpot 0.1

1. Profile: time the engine's prefill program per (batch, padded length) and its decode
   step per (active batch, context) -- small grids taken from the workload -- plus the
   KV transfer per token (see profile.py).
2. Fit the simulator's latency models (`fit_prefill`, `fit_decode`) per candidate.
3. Simulate the workload (`simulate_disaggregated` / `simulate_colocated`) for every
   split of `--num_devices` into `prefill=P,decode=DxT` (all devices used, T up to
   `--max_decode_tp`) and `colocated=N`; search each one's goodput (the highest rate
   with >= 90% of requests meeting both SLOs) by bisection on the simulator.
4. Print the candidates ranked by simulated goodput (then attainment at `--rate`,
   then p90 TTFT), best first.

Every candidate is one prefill instance and one decode instance, as one jaxpd engine
runs them (one prefill thread, one decode step over all dp shards). What a split's
devices buy depends on `--assume`:
- `measured` (default): each mesh shape is profiled on exactly that many devices here,
  so the models carry what those devices really give on this machine. On virtual CPU
  devices that share a few cores, more devices bring communication, not compute.
- `ideal`: profile one device only and scale as perfect hardware would: tp divides
  every prefill and decode coefficient by T, dp divides the per-request and per-token
  decode work by D (shards run in parallel), nothing costs communication.
Not modelled in either: interference between prefill and decode sharing cores,
KV memory limits and preemption, the prefill token cap, and prompts are simulated at
their padded bucket length (the engine computes the padding).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Sequence

from jaxpd.bench.args import (length_mix, positive_float, positive_floats, positive_int,
                              resolve_model, serving_mesh, whole_numbers)
from jaxpd.bench.driver import ensure_cpu_devices
from jaxpd.bench.workload import make_workload, parse_length_mix
from jaxpd.engine.scheduling.buckets import length_buckets
from jaxpd.metrics import find_goodput, slo_attainment, summarize
from jaxpd.plan.simulator import (DecodeModel, PrefillModel, fit_decode, fit_prefill,
                                  simulate_colocated, simulate_disaggregated)

GOODPUT_TARGET = 0.9


def enumerate_splits(num_devices: int, max_decode_tp: int = 2) -> list[str]:
    """Every `prefill=P,decode=DxT` with P + D*T = num_devices (T a power of two up to
    `max_decode_tp` dividing the decode devices), then `colocated=num_devices`."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    splits = []
    for prefill in range(1, num_devices):
        decode = num_devices - prefill
        tp = 1
        while tp <= min(max_decode_tp, decode):
            if decode % tp == 0:
                splits.append(f"prefill={prefill},decode={decode // tp}"
                              + (f"x{tp}" if tp > 1 else ""))
            tp *= 2
    return splits + [f"colocated={num_devices}"]


@dataclasses.dataclass(frozen=True)
class LatencyModels:
    """What the simulator needs to replay a workload on one candidate."""
    prefill: PrefillModel
    decode: DecodeModel
    decode_batch: int                # slots of the one decode instance
    transfer_s_per_token: float


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A candidate's simulated outcome."""
    mesh: str
    slots_per_shard: int
    goodput_req_s: float | None
    attainment: float                # at the planner's --rate
    ttft_s: dict
    tpot_s: dict
    models: LatencyModels

    def as_dict(self) -> dict:
        return {"mesh": self.mesh, "slots_per_shard": self.slots_per_shard,
                "goodput_req_s": self.goodput_req_s, "slo_attainment": self.attainment,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "prefill_model": dataclasses.asdict(self.models.prefill),
                "decode_model": dataclasses.asdict(self.models.decode),
                "decode_batch": self.models.decode_batch,
                "transfer_s_per_token": self.models.transfer_s_per_token}


class Planner:
    """Profiles (lazily, each mesh shape once), fits, simulates and ranks candidates."""

    def __init__(self, profiler, assume: str, rate: float, num_requests: int,
                 prompt_lens: str, output_lens: str, seed: int, slo_ttft: float,
                 slo_tpot: float, max_prefill_batch: int = 8,
                 profile_batches: Sequence[int] = (1, 4), goodput_range: tuple | None = None,
                 log=lambda message: None):
        if assume not in ("measured", "ideal"):
            raise ValueError(f"assume must be 'measured' or 'ideal', got {assume!r}")
        self.profiler, self.assume, self.log = profiler, assume, log
        self.rate, self.num_requests, self.seed = rate, num_requests, seed
        self.prompt_lens, self.output_lens = prompt_lens, output_lens
        self.slo_ttft, self.slo_tpot = slo_ttft, slo_tpot
        self.max_prefill_batch = max_prefill_batch
        self.profile_batches = sorted({min(b, max_prefill_batch) for b in profile_batches})
        self.goodput_range = goodput_range or (rate / 100, rate * 100)
        prompts = [n for n, _ in parse_length_mix(prompt_lens)]
        outputs = [n for n, _ in parse_length_mix(output_lens)]
        page = profiler.page_size
        self.buckets = length_buckets(max(prompts) + max(outputs), max(16, page))
        self.prompt_buckets = sorted({self._bucket(n) for n in prompts} | {self.buckets[0]})
        self.contexts = sorted({min(prompts) + 1, max(prompts) + max(outputs)})
        self._prefill_cache: dict[int, list] = {}
        self._decode_cache: dict[tuple, list] = {}
        self._transfer: float | None = None

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if n >= 1 and n <= b)

    # ---- profiles -------------------------------------------------------------------

    def _prefill_samples(self, tp: int):
        if tp not in self._prefill_cache:
            self.log(f"profiling prefill on tp={tp}: lengths {self.prompt_buckets}, "
                     f"batches {self.profile_batches}")
            self._prefill_cache[tp] = self.profiler.prefill(
                tp, self.prompt_buckets, self.profile_batches,
                max_tokens=max(8 * 256, self.buckets[-1]))
        return self._prefill_cache[tp]

    def _decode_samples(self, dp: int, tp: int, slots: int):
        key = (dp, tp, slots)
        if key not in self._decode_cache:
            batches = (1, dp * slots)
            self.log(f"profiling decode on {dp}x{tp} with {dp * slots} slots: contexts "
                     f"{self.contexts}, active {sorted(set(batches))}")
            self._decode_cache[key] = self.profiler.decode(dp, tp, slots, self.contexts, batches)
        return self._decode_cache[key]

    def transfer_s_per_token(self) -> float:
        """Profiled seconds per prompt token to move KV (the longest prompt bucket, once)."""
        if self._transfer is None:
            self._transfer = self.profiler.transfer_s_per_token(self.prompt_buckets[-1])
        return self._transfer

    def models_for(self, mesh: str, slots_per_shard: int) -> LatencyModels:
        """Fitted latency models of one candidate, under this planner's assumption."""
        from jaxpd.sharding.spec import parse_mesh_spec
        spec = parse_mesh_spec(mesh)
        transfer = 0.0 if spec.colocated else self.transfer_s_per_token()
        decode_batch = spec.decode_dp * slots_per_shard
        if self.assume == "measured":
            prefill = fit_prefill(self._prefill_samples(spec.prefill_tp))
            decode = fit_decode(self._decode_samples(spec.decode_dp, spec.decode_tp,
                                                     slots_per_shard))
            return LatencyModels(prefill, decode, decode_batch, transfer)
        one_prefill = fit_prefill(self._prefill_samples(1))
        one_decode = fit_decode(self._decode_samples(1, 1, slots_per_shard))
        p, d, t = spec.prefill_tp, spec.decode_dp, spec.decode_tp
        prefill = PrefillModel(one_prefill.a / p, one_prefill.b / p, one_prefill.c / p)
        decode = DecodeModel(one_decode.a / t, one_decode.b / (d * t), one_decode.c / (d * t))
        return LatencyModels(prefill, decode, decode_batch, transfer)

    # ---- simulation -----------------------------------------------------------------

    def workload(self, rate: float):
        """The planner's workload at `rate`, prompts at their padded bucket length."""
        workload = make_workload(self.num_requests, rate, self.prompt_lens, self.output_lens,
                                 self.seed)
        return [dataclasses.replace(w, prompt_len=self._bucket(w.prompt_len)) for w in workload]

    def simulate(self, mesh: str, models: LatencyModels, rate: float):
        from jaxpd.sharding.spec import parse_mesh_spec
        workload = self.workload(rate)
        if parse_mesh_spec(mesh).colocated:
            return simulate_colocated(workload, models.prefill, models.decode, 1,
                                      self.max_prefill_batch, models.decode_batch)
        return simulate_disaggregated(workload, models.prefill, models.decode, 1, 1,
                                      self.max_prefill_batch, models.decode_batch,
                                      models.transfer_s_per_token)

    def predict(self, mesh: str, slots_per_shard: int) -> Prediction:
        """Simulated goodput, and attainment/TTFT/TPOT at `rate`, of one candidate."""
        models = self.models_for(mesh, slots_per_shard)

        def attainment(rate: float) -> float:
            return slo_attainment(self.simulate(mesh, models, rate), self.slo_ttft,
                                  self.slo_tpot)

        lo, hi = self.goodput_range
        goodput = find_goodput(attainment, lo, hi, target=GOODPUT_TARGET, rel_tol=0.02,
                               max_iters=40)
        timelines = self.simulate(mesh, models, self.rate)
        return Prediction(mesh, slots_per_shard, goodput,
                          slo_attainment(timelines, self.slo_ttft, self.slo_tpot),
                          summarize(t.ttft for t in timelines),
                          summarize(t.tpot for t in timelines if t.tpot is not None), models)

    def rank(self, meshes: Sequence[str], slots_per_shard: int) -> list[Prediction]:
        """Predictions for every mesh, best first."""
        predictions = [self.predict(m, slots_per_shard) for m in meshes]
        return sorted(predictions, key=_rank_key)


def _rank_key(p: Prediction):
    ttft = p.ttft_s["p90"] if p.ttft_s["p90"] is not None else math.inf
    return (-(p.goodput_req_s or 0.0), -p.attainment, ttft)


# ---- output --------------------------------------------------------------------------

def assumptions(args_assume: str, num_devices: int) -> list[str]:
    """The plain-language assumptions printed above the table."""
    lines = ["each candidate = one prefill instance + one decode instance (one jaxpd engine)"]
    if args_assume == "measured":
        lines.append(f"latencies measured on meshes of exactly each candidate's shape here "
                     f"({num_devices} devices); on virtual CPU devices sharing cores, extra "
                     f"devices add communication, not compute")
    else:
        lines.append("latencies measured on ONE device and scaled ideally: tp divides all "
                     "costs, dp divides per-request decode work, no communication cost")
    lines.append("not modelled: prefill/decode interference on shared cores, the engine's "
                 "host work per step (profiles time the device programs), KV memory limits "
                 "and preemption; prompts simulated at their padded bucket")
    return lines


def format_plan(predictions: Sequence[Prediction], rate: float, notes: Sequence[str],
                max_rate: float | None = None) -> str:
    """The ranked table (latencies in ms), with the assumptions on top. A goodput equal
    to the search's `max_rate` is shown as '>=': the search passed its top probe."""
    header = ["rank", "split", "slots", "goodput req/s", f"attain@{rate:g}/s %",
              "TTFT mean ms", "TTFT p90 ms", "TPOT mean ms", "TPOT p90 ms"]
    rows = []
    for i, p in enumerate(predictions, 1):
        def ms(d, key):
            return "-" if d[key] is None else f"{d[key] * 1e3:.1f}"
        goodput = "-" if p.goodput_req_s is None else f"{p.goodput_req_s:.3g}"
        if p.goodput_req_s is not None and p.goodput_req_s == max_rate:
            goodput = ">=" + goodput
        rows.append([str(i), p.mesh, str(p.models.decode_batch), goodput,
                     f"{100 * p.attainment:.1f}", ms(p.ttft_s, "mean"), ms(p.ttft_s, "p90"),
                     ms(p.tpot_s, "mean"), ms(p.tpot_s, "p90")])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = [f"# {n}" for n in notes]
    for j, row in enumerate([header] + rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpd.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the built-in default model)")
    p.add_argument("--num_devices", type=positive_int, default=8, help="devices to split")
    p.add_argument("--assume", choices=("measured", "ideal"), default="measured",
                   help="profile every mesh shape here, or one device scaled ideally")
    p.add_argument("--max_decode_tp", type=positive_int, default=2,
                   help="largest decode tp (T of decode=DxT) among the candidates")
    p.add_argument("--splits", default=None,
                   help="';'-separated meshes to rank instead of every split, e.g. "
                        "'prefill=2,decode=6;colocated=8'")
    p.add_argument("--rate", type=positive_float, default=1.0,
                   help="request rate at which attainment, TTFT and TPOT are predicted")
    p.add_argument("--num_requests", type=positive_int, default=200,
                   help="requests in each simulated workload")
    p.add_argument("--prompt_lens", type=length_mix, default="64:3,512:4,768:1",
                   help="prompt length mix 'len:weight,...'")
    p.add_argument("--output_lens", type=length_mix, default="128", help="output length mix")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--slo_ttft", type=positive_float, default=1.0, help="TTFT SLO, seconds")
    p.add_argument("--slo_tpot", type=positive_float, default=0.1, help="TPOT SLO, seconds")
    p.add_argument("--slots_per_shard", type=positive_int, default=8,
                   help="decode slots per dp shard (as the engine's option)")
    p.add_argument("--max_prefill_batch", type=positive_int, default=8,
                   help="prompts per prefill batch (as the engine's option)")
    p.add_argument("--profile_batches", type=positive_floats, default=[1, 4],
                   help="prefill batch sizes profiled")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls per profiled shape (the best counts)")
    p.add_argument("--goodput_max_rate", type=positive_float, default=None,
                   help="highest rate the simulated goodput search probes (default: 100 x --rate; "
                        "the lowest is --rate / 100)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the ranking as JSON here")
    live = p.add_argument_group("live recommendation (nothing is profiled; nothing is changed)")
    live.add_argument("--live", default=None, metavar="URL",
                      help="a running deployment's /metrics URL (router or single process "
                           "HTTP port): print the split the elastic controller would move to")
    live.add_argument("--live_split", default="prefill=4,decode=4",
                      help="the deployment's split now, prefill=P,decode=D")
    live.add_argument("--live_interval_s", type=positive_float, default=10.0,
                      help="seconds between scrapes")
    live.add_argument("--live_count", type=positive_int, default=None,
                      help="scrapes before exiting (default: until interrupted)")
    live.add_argument("--live_sustain_s", type=positive_float, default=30.0,
                      help="a move must be wanted this long before it is recommended")
    live.add_argument("--live_dwell_s", type=positive_float, default=120.0,
                      help="no move within this long of the last one")
    live.add_argument("--live_efficiency", type=float, default=1.0,
                      help="the latency model's scaling: time per unit of work ~ "
                           "(devices now / after) ** this, in [0, 1] (1: as --assume ideal)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    from jaxpd.sharding.spec import parse_mesh_spec
    if args.splits:
        try:
            specs = [parse_mesh_spec(serving_mesh(s.strip()))
                     for s in args.splits.split(";") if s.strip()]
        except ValueError as e:
            parser.error(f"--splits: {e}")
        if not specs:
            parser.error("--splits: no mesh given")
        too_big = [str(s) for s in specs if s.num_devices > args.num_devices]
        if too_big:
            parser.error(f"--splits: {too_big[0]} needs more than --num_devices={args.num_devices}")
        args.splits = [str(s) for s in specs]
    if args.goodput_max_rate is not None and args.goodput_max_rate < args.rate / 100:
        parser.error(f"--goodput_max_rate={args.goodput_max_rate} is below --rate / 100")
    if not 0 <= args.live_efficiency <= 1:
        parser.error(f"--live_efficiency must be in [0, 1], got {args.live_efficiency}")
    args.profile_batches = whole_numbers(parser, "profile_batches", args.profile_batches)
    return args


def main(argv: Sequence[str] | None = None) -> list[Prediction]:
    """Profile, simulate and print the ranking the flags describe (or, with --live,
    watch a deployment and print the controller's recommendations)."""
    args = parse_args(argv)
    if args.live:
        from jaxpd.plan.controller import SplitController
        from jaxpd.plan.live import parse_split, run_live
        try:
            split = parse_split(args.live_split)
        except ValueError as e:
            build_parser().error(str(e))
        controller = SplitController(split, args.slo_ttft, args.slo_tpot,
                                     sustain_s=args.live_sustain_s, dwell_s=args.live_dwell_s,
                                     efficiency=args.live_efficiency)
        try:
            run_live(args.live, controller, args.live_interval_s, args.live_count)
        except KeyboardInterrupt:
            pass
        return []
    ensure_cpu_devices(args.num_devices if args.assume == "measured" else 2)
    model_dir = resolve_model(args.model)
    from jaxpd.plan.profile import MeshProfiler
    profiler = MeshProfiler(model_dir, repeats=args.repeats)
    planner = Planner(profiler, args.assume, args.rate, args.num_requests, args.prompt_lens,
                      args.output_lens, args.seed, args.slo_ttft, args.slo_tpot,
                      args.max_prefill_batch, args.profile_batches,
                      goodput_range=(args.rate / 100, args.goodput_max_rate or 100 * args.rate),
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    meshes = args.splits or enumerate_splits(args.num_devices, args.max_decode_tp)
    ranking = planner.rank(meshes, args.slots_per_shard)
    notes = assumptions(args.assume, args.num_devices) + [
        f"workload: {args.num_requests} requests, prompts {args.prompt_lens}, outputs "
        f"{args.output_lens}, seed {args.seed}; SLO TTFT {args.slo_ttft:g}s, TPOT "
        f"{args.slo_tpot:g}s; goodput = highest simulated rate with >= 90% attainment",
        f"KV transfer {planner.transfer_s_per_token() * 1e6:.2f} us/token (device_put, "
        f"first device to last)"]
    print(format_plan(ranking, args.rate, notes, planner.goodput_range[1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"assume": args.assume, "notes": notes,
                       "ranking": [p.as_dict() for p in ranking]}, f, indent=1)
    return ranking


if __name__ == "__main__":
    main()
