"""`python -m jaxpd.bench`: the workload driver end to end on a tiny model, and its flags.

No wall-clock assertions: the machine running the tests is shared and noisy. What
must hold whatever the timing: the JSON has the documented shape, every request of
every run is counted, attainment is a fraction, the same prompts go to every backend.
"""
import contextlib
import json

import numpy as np
import pytest

from jaxpd.bench import cli as bench
from jaxpd.bench.elastic import plot_split
from jaxpd.bench.driver import make_bench_requests
from jaxpd.bench.workload import make_workload
from tests.cli_fixtures import assert_flag_rejected

NUM_REQUESTS = 5
LATENCY_KEYS = {"mean", "p50", "p90", "p99"}
RUN_KEYS = {"name", "ttft_s", "tpot_s", "itl_s", "e2e_s", "output_tok_s", "req_s",
            "slo_attainment", "goodput_req_s"}


@pytest.fixture(scope="module")
def tiny_dir(tiny_hf_model):
    return tiny_hf_model[0]     # the session's tiny llama_gqa checkpoint (read only)


def _flags(model_dir, *extra):
    return ["--model", model_dir, "--num_requests", str(NUM_REQUESTS), "--rate", "20",
            "--prompt_lens", "16:2,40:1", "--output_lens", "6:1,3:1", "--seed", "3",
            "--max_prefill_batch", "2", "--slots_per_shard", "2", "--hf_batch", "4",
            "--warmup_requests", "1", "--no_progress", *extra]


@pytest.mark.slow
def test_bench_runs_meshes_processes_and_hf_on_the_same_requests(tiny_dir, tmp_path, capsys):
    """Every backend kind in one run: an in-process disaggregated mesh, colocated, the
    pinned multi-process deployment (router + prefill + decode workers it starts and
    stops), transformers."""
    out = tmp_path / "bench.json"
    results = bench.main(_flags(tiny_dir, "--mesh", "prefill=1,decode=1",
                                "--compare", "colocated=2,hf", "--deployment", "processes",
                                "--prefill_cpus", "0", "--decode_cpus", "1",
                                "--warmup_requests", "0",      # no compile-ahead: a smoke run
                                "--prefix_caching", "off", "--json", str(out)))
    printed = capsys.readouterr().out
    processes = "processes(prefill=1@cpu0,decode=1@cpu1)"
    for name in ("prefill=1,decode=1", "colocated=2", processes, "hf"):
        assert name in printed

    doc = json.loads(out.read_text())
    assert set(doc) >= {"runs", "workload", "devices"}
    assert [r["name"] for r in doc["runs"]] == ["prefill=1,decode=1", "colocated=2", processes,
                                                "hf"]
    assert doc["workload"]["deployment"]["decode_cpus"] == "1"
    for run in doc["runs"]:
        assert set(run) >= RUN_KEYS
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(run[key]) == LATENCY_KEYS
            assert all(v is not None and v >= 0 for v in run[key].values())
        assert run["num_requests"] == NUM_REQUESTS
        assert run["num_aborted"] == 0
        assert 0.0 <= run["slo_attainment"] <= 1.0
        assert run["goodput_req_s"] is None          # not asked for
        assert run["output_tok_s"] > 0 and run["req_s"] > 0
    engine_runs = doc["runs"][:2]
    for run in engine_runs:
        stats = run["engine_stats"]
        assert stats["finished"] == NUM_REQUESTS and stats["aborted"] == 0
    assert engine_runs[0]["engine_stats"]["transfers"] == NUM_REQUESTS
    # --prefix_caching off: the cache the disaggregated mesh has by default stays off.
    assert engine_runs[0]["engine_options"]["enable_prefix_caching"] is False
    assert engine_runs[0]["engine_stats"]["prefix_query_tokens"] == 0
    router = doc["runs"][2]["engine_stats"]
    assert router["finished"] == NUM_REQUESTS and router["aborted"] == 0
    assert [len(router["workers"][role]) for role in ("prefill", "decode")] == [1, 1]
    assert doc["workload"]["num_requests"] == NUM_REQUESTS
    assert doc["devices"]["num_devices"] >= 2
    # The returned document is the one written.
    assert results["runs"][0]["name"] == doc["runs"][0]["name"]

    # Every run produced exactly the tokens the workload asks for.
    workload = make_workload(NUM_REQUESTS, 20.0, "16:2,40:1", "6:1,3:1", 3)
    expected_tokens = sum(w.output_len for w in workload)
    for run in doc["runs"]:
        duration = NUM_REQUESTS / run["req_s"]
        assert run["output_tok_s"] * duration == pytest.approx(expected_tokens)


@pytest.mark.slow
def test_rate_sweep_and_goodput_search_name_each_run(tiny_dir, tmp_path):
    results = bench.main(_flags(tiny_dir, "--mesh", "prefill=1,decode=1", "--compare", "none",
                                "--rates", "10,40", "--goodput", "--goodput_max_iters", "0",
                                "--slo_ttft", "100", "--slo_tpot", "100"))
    runs = results["runs"]
    assert [r["name"] for r in runs] == ["prefill=1,decode=1@10/s", "prefill=1,decode=1@40/s"]
    # Generous SLOs: everything passes, so the search's first probe (its top rate) wins.
    assert all(r["slo_attainment"] == 1.0 for r in runs)
    assert all(r["goodput_req_s"] == 160.0 for r in runs)


@pytest.mark.slow
def test_shift_workload_reports_each_phase(tiny_dir, capsys):
    """`--workload shift`: the phases one after the other, SLO attainment and
    latencies per phase beside the overall run."""
    results = bench.main(_flags(tiny_dir, "--mesh", "prefill=1,decode=1", "--compare",
                                "none", "--workload", "shift",
                                "--phases", "40/3/3;16/6/2", "--slo_ttft", "100",
                                "--slo_tpot", "100", "--warmup_requests", "0"))
    assert results["workload"]["phases"][1] == {"prompt_lens": "16", "output_lens": "6",
                                                "num_requests": 2}
    for run in results["runs"]:
        assert run["num_requests"] == 5 and run["slo_attainment"] == 1.0
        assert [(p["phase"], p["num_requests"], p["slo_attainment"]) for p in run["phases"]] == [
            (0, 3, 1.0), (1, 2, 1.0)]
        assert all(p["ttft_p50_s"] > 0 and p["tpot_p50_s"] > 0 for p in run["phases"])
        assert all(p["goodput_rps"] > 0 for p in run["phases"])   # every request met the SLOs
    assert "phase 1 16->6" in capsys.readouterr().out


@pytest.mark.slow
def test_an_elastic_mesh_moves_its_split_during_the_shift_workload(tiny_dir, capsys):
    """`--mesh elastic=3`: the controller acts during the run. A TTFT SLO no prefill
    meets and a TPOT SLO every decode does: one device moves to prefill (then decode
    is at its floor of one), said with its reason, recorded over time."""
    results = bench.main(_flags(tiny_dir, "--mesh", "elastic=3,prefill=1", "--compare", "none",
                                "--workload", "shift", "--phases", "40/3/3;16/6/3",
                                "--rate", "0.5", "--slo_ttft", "0.0001", "--slo_tpot", "100",
                                "--warmup_requests", "0", "--elastic_interval_s", "0.2",
                                "--elastic_sustain_s", "0", "--elastic_dwell_s", "0",
                                "--slots_per_shard", "8"))
    [run] = results["runs"]
    assert run["num_requests"] == 6 and run["num_aborted"] == 0
    stats = run["engine_stats"]
    assert [(d["old"], d["new"]) for d in stats["resplit_decisions"]] == [
        ("prefill=1,decode=2", "prefill=2,decode=1")]
    assert "prefill at" in stats["resplit_decisions"][0]["reason"]
    assert stats["resplits"] == 1
    devices = [p["prefill_devices"] for p in stats["split_timeline"]]
    assert devices[0] == 1 and devices[-1] == 2 and devices == sorted(devices)
    assert "elastic=3,prefill=1: t=" in capsys.readouterr().out.split("elastic moves:")[1]
    drawn = _Axes()
    plot_split(drawn, [run])
    assert drawn.lines[0] == ("step", [p["prefill_devices"] for p in stats["split_timeline"]])
    assert [kind for kind, _ in drawn.lines] == ["step", "plot", "plot"]


class _Axes:
    """Records what is drawn on it (matplotlib is an optional extra)."""

    def __init__(self):
        self.lines = []

    def step(self, x, y, **kw):
        self.lines.append(("step", list(y)))

    def plot(self, x, y, **kw):
        self.lines.append(("plot", list(y)))

    def __getattr__(self, name):       # labels, title, grid, legend
        return lambda *a, **kw: None


def test_prompts_are_fixed_by_the_seed_not_the_rate():
    slow = make_bench_requests(make_workload(6, 1.0, "16:1,64:1", "8", seed=5), 256, 5)
    fast = make_bench_requests(make_workload(6, 9.0, "16:1,64:1", "8", seed=5), 256, 5)
    assert [r.prompt_ids for r in slow] == [r.prompt_ids for r in fast]
    assert [r.arrival_s * 9.0 for r in fast] == pytest.approx([r.arrival_s for r in slow])
    other = make_bench_requests(make_workload(6, 1.0, "16:1,64:1", "8", seed=6), 256, 6)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in slow]
    assert all(3 <= t < 256 for r in slow for t in r.prompt_ids)
    # Another draw: the same lengths and arrivals, other prompts, as fixed as the first.
    drawn = make_bench_requests(make_workload(6, 1.0, "16:1,64:1", "8", seed=5), 256, 5, draw=1)
    assert [len(r.prompt_ids) for r in drawn] == [len(r.prompt_ids) for r in slow]
    assert [r.arrival_s for r in drawn] == [r.arrival_s for r in slow]
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(drawn, slow))
    assert drawn == make_bench_requests(make_workload(6, 1.0, "16:1,64:1", "8", seed=5),
                                        256, 5, draw=1)


@pytest.mark.parametrize("flags, named", [
    (["--rate", "0"], "--rate"),
    (["--rate", "fast"], "--rate"),
    (["--rates", "1,,2"], "--rates"),
    (["--num_requests", "-3"], "--num_requests"),
    (["--prompt_lens", "64:x"], "--prompt_lens"),
    (["--output_lens", ""], "--output_lens"),
    (["--mesh", "prefill=4"], "--mesh"),
    (["--compare", "colocated=8,gpt"], "--compare"),
    (["--mesh", "colocated=2", "--compare", "colocated=2"], "--compare"),
    (["--slo_tpot", "-1"], "--slo_tpot"),
    (["--goodput_min_rate", "4", "--goodput_max_rate", "1"], "--goodput_max_rate"),
    (["--unknown_flag", "1"], "--unknown_flag"),
    (["--deployment", "pods"], "--deployment"),
    (["--deployment", "processes", "--process_mesh", "colocated=2"], "--process_mesh"),
    (["--deployment", "processes", "--prefill_cpus", "0"], "--decode_cpus"),
    (["--deployment", "processes", "--prefill_cpus", "0", "--decode_cpus", "0"], "--decode_cpus"),
    (["--deployment", "processes", "--prefill_cpus", "0", "--decode_cpus", "4096"],
     "--decode_cpus"),
    (["--prefill_cpus", "0", "--decode_cpus", "1"], "--prefill_cpus"),
    (["--deployment", "processes", "--process_kv_transport", "pigeon"],
     "--process_kv_transport"),
    (["--workload", "shift", "--phases", "448/16"], "--phases"),
    (["--dataset", "wiki"], "--dataset"),
    (["--dataset", "random", "--workload", "shift"], "--dataset"),
    (["--input_len", "64:32"], "--input_len"),
    (["--random-output-len", "0"], "--output_len"),
    (["--num-prompts", "0"], "--num_requests"),
])
def test_bad_flags_are_rejected_naming_the_flag(flags, named, capsys):
    assert_flag_rejected(bench.parse_args, flags, named, capsys)


def test_flags_parse_and_compare_keeps_mesh_pairs_whole():
    args = bench.parse_args(["--mesh", "prefill=2,decode=2", "--compare",
                             "prefill=1,decode=3,colocated=4,hf", "--rates", "0.5,1"])
    assert args.compare == ["prefill=1,decode=3", "colocated=4", "hf"]
    assert args.rates == [0.5, 1.0]
    assert bench.meshes_of(args) == ["prefill=2,decode=2", "prefill=1,decode=3", "colocated=4"]
    assert bench.num_devices_needed(args) == 4
    defaults = bench.parse_args([])
    assert (defaults.mesh, defaults.compare, defaults.rates) == (
        "auto", ["colocated=8"], [1.0])
    assert bench.num_devices_needed(defaults) == 8
    # "auto" is checked against --compare and --decode_slots once resolved (in main).
    args = bench.parse_args(["--compare", "prefill=1,decode=1,hf", "--decode_slots", "32"])
    assert args.mesh == "auto" and bench.num_devices_needed(args) == 2
    args.mesh, said = "prefill=1,decode=1", []
    bench.check_meshes(args, said.append)
    assert said == ["--compare: prefill=1,decode=1 is already the --mesh under test"]
    # Every flag documents its default.
    for action in bench.build_parser()._actions:
        if action.dest != "help":
            assert action.help, action.dest


def test_process_deployment_splits_the_cpus_and_names_them():
    from jaxpd.bench.processes import cpu_ranges, make_deployment, worker_flags
    assert cpu_ranges([5, 0, 1, 2, 7, 6]) == "0-2,5-7"
    d = make_deployment("prefill=2,decode=1", None, None, allowed=[0, 1, 2, 3, 4])
    assert (d.prefill_mesh, d.decode_mesh, d.prefill_cpus, d.decode_cpus) == (
        "prefill=2", "decode=1", "0-2", "3-4")
    assert d.name == "processes(prefill=2@cpu0-2,decode=1@cpu3-4)"
    with pytest.raises(ValueError, match="--prefill_cpus and --decode_cpus"):
        make_deployment("prefill=1,decode=1", None, None, allowed=[0])
    prefill, decode = worker_flags(d, "/m", dict(max_model_len=64, slots_per_shard=4,
                                                 enable_prefix_caching=True))
    assert prefill[prefill.index("--cpus") + 1] == "0-2"
    assert decode[decode.index("--mesh") + 1] == "decode=1"
    assert decode[decode.index("--slots_per_shard") + 1] == "4"
    assert "--enable_prefix_caching" in decode and "--max_prefill_batch" not in decode
    assert decode[decode.index("--kv_transport") + 1] == "transfer_server"
    off = worker_flags(d, "/m", dict(max_model_len=64, enable_prefix_caching=False))
    assert all("--noenable_prefix_caching" in flags for flags in off)
    unset = worker_flags(d, "/m", dict(max_model_len=64))    # each worker's default
    assert not any("prefix_caching" in f for flags in unset for f in flags)
    grpc = make_deployment("prefill=1,decode=1", "0", "1", allowed=[0, 1], kv_transport="grpc")
    assert grpc.name == "processes(prefill=1@cpu0,decode=1@cpu1,grpc)"
    # A prefill role spanning processes: one argument list per process, the leader first,
    # all with the same coordinator and --kv_offers; followers serve no address.
    from jaxpd.bench.processes import Deployment
    from jaxpd.bench.workers import LaunchedWorker
    spread = Deployment("prefill=4", "decode=1", "0", "1", prefill_processes=2,
                        kv_offers="gather")
    assert spread.name == "processes(prefill=4 over 2 processes, kv gather@cpu0,decode=1@cpu1)"
    leader, follower, decode = worker_flags(spread, "/m", dict(max_model_len=64))
    value = lambda flags, name: flags[flags.index(name) + 1]
    assert [value(f, "--process_id") for f in (leader, follower)] == ["0", "1"]
    assert value(leader, "--coordinator") == value(follower, "--coordinator")
    assert value(follower, "--kv_offers") == "gather" and "--process_id" not in decode
    assert [LaunchedWorker.is_follower.fget(type("W", (), {"args": f})())
            for f in (leader, follower, decode)] == [False, True, False]


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--model: .*no config.json"):
        bench.main(["--model", str(tmp_path), "--compare", "none"])


@pytest.mark.slow
def test_layerwise_bench_compares_both_modes_on_the_same_prompts(tiny_dir, tmp_path, capsys):
    from jaxpd.bench import layerwise as bench_layerwise
    out = tmp_path / "layerwise.json"
    assert bench_layerwise.main(["--model", tiny_dir, "--transports", "device_put",
                                 "--prompt_lens", "40", "--repeats", "2", "--parts", "2",
                                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layerwise" in printed and "T2T p50" in printed
    data = json.loads(out.read_text())
    # Both modes, every length, every repeat; the bench itself checks equal tokens.
    assert {(s["prompt_len"], s["mode"], s["n"]) for s in data["summary"]} == {
        (40, m, 2) for m in ("request", "layerwise")}
    for s in data["samples"]:
        assert 0 < s["ttft_ms"] <= s["t2t_ms"]


@pytest.mark.parametrize("flags,named", [
    (["--transports", "carrier_pigeon"], "transports"),
    (["--prompt_lens", "0"], "prompt_lens"),
    (["--random_model", "depth=3"], "random_model"),
    (["--parts", "1"], "parts"),
])
def test_layerwise_bench_rejects_bad_flags(flags, named, capsys):
    from jaxpd.bench import layerwise as bench_layerwise
    assert_flag_rejected(bench_layerwise.build_parser().parse_args, flags, named, capsys)


@pytest.mark.slow
def test_prefix_workloads_run_each_mesh_with_the_cache_off_and_on(tiny_dir, tmp_path, capsys):
    """multiturn (prefix_repetition differs only in how `make_chats` draws prompts)."""
    workload = "multiturn"
    out = tmp_path / "prefix.json"
    results = bench.main(["--model", tiny_dir, "--workload", workload, "--mesh", "colocated=1",
                          "--compare", "none", "--conversations", "3", "--turns", "3",
                          "--system_len", "40", "--user_len", "5", "--think_s", "0",
                          "--num_requests", "6", "--num_prefixes", "2", "--prefix_len", "40",
                          "--output_lens", "4", "--rate", "50", "--slots_per_shard", "2",
                          "--max_prefill_batch", "1", "--warmup_requests", "0",
                          "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    off, on = results["runs"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert on["outputs_identical"] is True
    # The same requests: the same prompt tokens; the cache computes fewer of them.
    assert off["prompt_tokens"] == on["prompt_tokens"] == off["prefill_tokens"]
    assert on["prefill_tokens"] < off["prefill_tokens"] and on["hit_rate"] > 0
    assert off["hit_rate"] == 0
    for run in (off, on):              # the default SLOs (1 s, 0.1 s): whatever was met
        assert 0 <= run["slo_attainment"] <= 1 and run["goodput_req_s"] >= 0
        assert (run["goodput_req_s"] > 0) == (run["slo_attainment"] > 0)
    assert "greedy outputs identical with the cache on and off: True" in capsys.readouterr().out


def test_settle_workers_waits_for_every_workers_background_compiles(monkeypatch):
    from jaxpd.bench import processes

    class Router:                  # pending compiles on two workers: 2+1, then 1, then 0
        def __init__(self):
            self.answers = iter([(2, 1), (1, 0), (0, 0)])
            self.asked = 0

        def stats(self):
            self.asked += 1
            p, d = next(self.answers)
            return {"workers": {"prefill": [{"compiles_pending": p}],
                                "decode": [{"compiles_pending": d}, {}]}}

    monkeypatch.setattr(processes.time, "sleep", lambda s: None)
    router = Router()
    processes.settle_workers(router)
    assert router.asked == 3
    router.answers = iter([(1, 0)] * 10**6)
    clock = iter(range(10**6))
    monkeypatch.setattr(processes.time, "monotonic", lambda: next(clock))
    with pytest.raises(TimeoutError, match="still compiling after 5 s"):
        processes.settle_workers(router, timeout_s=5)


def test_prefix_workload_flags_are_checked(capsys):
    assert_flag_rejected(bench.parse_args, ["--workload", "chat"], "--workload", capsys)
    assert_flag_rejected(bench.parse_args, ["--think_s", "-1"], "--think_s", capsys)
    assert_flag_rejected(bench.parse_args, ["--turns", "0"], "--turns", capsys)
    assert_flag_rejected(bench.parse_args, ["--workload", "multiturn", "--prefix_caching", "on"],
                         "--prefix_caching", capsys)
    assert_flag_rejected(bench.parse_args, ["--prefix_caching", "maybe"], "--prefix_caching",
                         capsys)
    assert_flag_rejected(bench.parse_args, ["--kv_host_cache_gb", "1"], "--kv_host_cache_gb",
                         capsys)                   # a poisson run has no host tier run
    assert_flag_rejected(bench.parse_args, ["--workload", "multiturn", "--kv_host_cache_gb",
                                            "-1"], "--kv_host_cache_gb", capsys)
    assert_flag_rejected(bench.parse_args, ["--prefill_host_cache_gb", "1"],
                         "--prefill_host_cache_gb", capsys)


def test_prefix_repetition_chats_reuse_each_prefix():
    from jaxpd.bench.prefix import make_chats
    args = bench.parse_args(["--workload", "prefix_repetition", "--num_requests", "6",
                             "--num_prefixes", "2", "--prefix_len", "20", "--user_len", "3"])
    chats = make_chats(args, vocab_size=256)
    assert len(chats) == 6 and all(len(c.turns) == 1 for c in chats)
    prefixes = {c.turns[0][:20] for c in chats}
    assert len(prefixes) == 2 and all(len(c.turns[0]) == 23 for c in chats)
    assert chats == make_chats(args, vocab_size=256)          # fixed by the seed


@pytest.mark.slow
def test_plan_traffic_bench_measures_each_message_shape(tmp_path, capsys):
    """`python -m jaxpd.bench.plan_traffic`: a leader and a follower on this machine; each
    batch shape's run and take messages delivered, sized and timed."""
    from jaxpd.bench import plan_traffic
    out = plan_traffic.main(["--repeats", "2", "--json", str(tmp_path / "plan.json")])
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(json.dumps(out))
    rows = {(r["batch"], r["tokens"], r["op"]): r for r in out["rows"]}
    assert set(rows) == {(b, t, op) for b, t in plan_traffic.SHAPES for op in ("run", "take")}
    # A run message carries its tokens (4 bytes each, msgpack and signature around them).
    assert all(rows[b, t, "run"]["bytes"] > 4 * b * t for b, t in plan_traffic.SHAPES)
    assert all(r["latency_us_p50"] > 0 and r["publish_us_p50"] > 0
               for r in out["rows"] + out["decode_rows"])
    # A decode role's: a step per (slots, width), an insert per page shape and count,
    # which carries its pages' bytes (k and v).
    steps = {(r["slots"], r["width"]): r for r in out["decode_rows"] if r["op"] == "step"}
    assert set(steps) == set(plan_traffic.STEPS)
    assert all(steps[b, w]["bytes"] > 4 * b * w for b, w in plan_traffic.STEPS)
    inserts = {(r["model"], r["pages"]): r for r in out["decode_rows"] if r["op"] == "insert"}
    page_bytes = {name: 2 * np.prod(shape) * (2 if dtype == "bfloat16" else 4)
                  for name, shape, dtype, _ in plan_traffic.PAGES}
    assert set(inserts) == {(name, n) for name, _, _, counts in plan_traffic.PAGES
                            for n in counts}
    assert all(r["bytes"] > page_bytes[name] * n for (name, n), r in inserts.items())
    assert "to follower p50/p99 us" in capsys.readouterr().out


def test_prefix_bench_sums_a_deployments_worker_counters():
    """The multi-process deployment's figures come from every live worker's engine
    counters (the router's Stats fan-out), summed: prefill tokens are computed on both
    roles, hits and KV moved on the decode side."""
    from jaxpd.bench.prefix import worker_counters
    from jaxpd.stats import COUNTERS

    class Router:
        def stats(self):
            return {"workers": {"prefill": [{"counters": {"prefill_tokens": 100}}],
                                "decode": [{"counters": {"prefill_tokens": 7,
                                                         "prefix_hit_tokens": 32,
                                                         "transfer_bytes": 4096}},
                                           {"address": "an older worker: no counters"}]}}

    total = worker_counters(Router())
    assert set(total) == set(COUNTERS)
    assert (total["prefill_tokens"], total["prefix_hit_tokens"], total["transfer_bytes"],
            total["finished"]) == (107, 32, 4096, 0)


def test_every_flag_has_its_hyphen_spelling_and_vllms_names():
    underscores = bench.parse_args([
        "--num_requests", "7", "--rate", "3", "--dataset", "random", "--input_len", "8:64",
        "--output_len", "4", "--max_model_len", "256", "--slo_ttft", "2", "--no_progress"])
    hyphens = bench.parse_args([
        "--num-requests", "7", "--rate", "3", "--dataset", "random", "--input-len", "8:64",
        "--output-len", "4", "--max-model-len", "256", "--slo-ttft", "2", "--no-progress"])
    vllm = bench.parse_args([
        "--num-prompts", "7", "--request-rate", "3", "--dataset-name", "random",
        "--random-input-len", "8:64", "--random-output-len", "4", "--max-model-len", "256",
        "--slo-ttft", "2", "--no-progress"])
    assert vars(underscores) == vars(hyphens) == vars(vllm)
    assert (vllm.num_requests, vllm.rates, vllm.input_len.lo, vllm.input_len.hi) == (
        7, [3.0], 8, 64)
    parser = bench.build_parser()
    for action in parser._actions:
        for name in action.option_strings:
            if name.startswith("--") and "_" in name:
                assert name.replace("_", "-") in action.option_strings
    usage = parser.format_help()
    for name in ("--num-prompts", "--request-rate", "--dataset-name", "--random-input-len",
                 "--random-output-len", "--foo-bar"):
        assert name in usage


def test_a_dataset_that_cannot_fit_the_model_is_refused_naming_it():
    from jaxpd.models.source import model_config_and_tokenizer
    model_dir = bench.resolve_model(None)       # the built-in model: no checkpoint to build
    positions = model_config_and_tokenizer(model_dir)[0].max_position_embeddings
    args = bench.parse_args(["--dataset", "long_mix", "--output_len", "8"])
    with pytest.raises(SystemExit, match=f"--dataset long_mix: .*4096 tokens plus 8 .*"
                                         f"max_position_embeddings={positions}"):
        bench.Benchmark(args, model_dir)
    args = bench.parse_args(["--dataset", "random", "--input_len", f"4:{positions}",
                             "--output_len", "8"])
    with pytest.raises(SystemExit, match=f"--input_len/--output_len: .*needs {positions + 8} "):
        bench.Benchmark(args, model_dir)
    # The lower --max_model_len bounds the requests, and is the engine's.
    args = bench.parse_args(["--dataset", "random", "--input_len", "4:30", "--output_len",
                             "2:8", "--max_model_len", "38", "--num_requests", "20"])
    b = bench.Benchmark(args, model_dir)
    requests = b.requests_at(1.0)
    assert b.max_model_len == 38 and len(requests) == 20
    assert all(4 <= len(r.prompt_ids) <= 30 and 2 <= r.output_len <= 8 for r in requests)
    faster = b.requests_at(5.0)
    assert [len(r.prompt_ids) for r in faster] == [len(r.prompt_ids) for r in requests]
    assert [r.arrival_s * 5.0 for r in faster] == pytest.approx([r.arrival_s for r in requests])
    assert not {r.prompt_ids for r in faster} & {r.prompt_ids for r in requests}
    assert b.requests_at(1.0) == requests       # a rate keeps its draw


def test_each_rate_of_a_sharegpt_sweep_sends_conversations_of_its_own(monkeypatch):
    """A cache on by default in one backend must not serve one rate from another's
    prompts: each rate, and the single-stream runs, get their own sampled pairs."""
    from jaxpd.bench import datasets
    from jaxpd.models.source import model_config_and_tokenizer
    model_dir = bench.resolve_model(None)
    tokenizer = model_config_and_tokenizer(model_dir)[1]
    words = ["list", "type", "module", "import", "string", "value", "class", "return"]

    def turn(i, n):
        return " ".join(words[(i + j) % 8] for j in range(n)) + f" {i}"

    conversations = [[{"from": "human", "value": turn(i, 6 + i % 9)},
                      {"from": "gpt", "value": turn(i, 5 + i % 7)}] for i in range(200)]
    monkeypatch.setattr(datasets, "sharegpt_file", lambda: contextlib.nullcontext("unused"))
    monkeypatch.setattr(datasets, "read_conversations", lambda path: conversations)
    args = bench.parse_args(["--dataset", "sharegpt", "--num_requests", "5", "--rates", "1,2",
                             "--single_stream", "2"])
    b = bench.Benchmark(args, model_dir)
    runs = [b.requests_at(1.0), b.requests_at(2.0),
            b.requests(1.0, b.draw("single"))]
    prompts = [{r.prompt_ids for r in run} for run in runs]
    assert [len(p) for p in prompts] == [5, 5, 5]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
    human_turns = {tuple(tokenizer.encode(c[0]["value"])) for c in conversations}
    assert set().union(*prompts) <= human_turns
    assert b.max_model_len >= max(len(r.prompt_ids) + r.output_len for run in runs for r in run)



@pytest.mark.slow
def test_bench_serves_the_random_dataset_end_to_end(tiny_dir):
    results = bench.main(_flags(tiny_dir, "--mesh", "prefill=1,decode=1", "--compare", "none",
                                "--dataset-name", "random", "--random-input-len", "8:40",
                                "--random-output-len", "2:5", "--warmup_requests", "0"))
    [run] = results["runs"]
    assert run["num_requests"] == NUM_REQUESTS and run["num_aborted"] == 0
    assert run["engine_stats"]["finished"] == NUM_REQUESTS
    workload = results["workload"]
    assert (workload["dataset"], workload["input_len"], workload["output_len"]) == (
        "random", "8:40", "2:5")
    assert workload["max_model_len"] <= 45
