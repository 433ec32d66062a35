"""`python -m jaxpd.bench.layerwise`: layer-wise vs request-level KV transfer, side by side.

    python -m jaxpd.bench.layerwise --transports device_put,transfer_server,grpc \\
        --prompt_lens 256,512,1000 --repeats 6 --json layerwise.json
    python -m jaxpd.bench.layerwise --random_model hidden=512,layers=8,heads=8,kv_heads=8

For each transport, two deployments that differ only in `layerwise_min_tokens` serve
the same long prompts one at a time (no queueing, so only the transfer path differs),
alternating request by request so machine noise hits both alike:
  device_put       two in-process engines, `prefill=4,decode=4` each;
  transfer_server  one decode worker process (`decode=4`) and two prefill worker
  grpc             processes (`prefill=4`: one request-level, one layer-wise), one
                   in-process `Router` per prefill worker, both on the same decode worker.
Each request asks for 2 greedy tokens. Measured per request, from submission:
  TTFT   the first token reaches the caller. jaxpd streams it as soon as it is sampled
         (in one process: at the prefill; across processes: with the last KV control
         message), so TTFT does not wait for the KV pages to move;
  T2T    the second token: it needs the KV in a decode slot, so the transfer that
         layer-wise transfer hides, or not, shows here;
  gap    T2T - TTFT.
Every deployment is warmed (each prompt length served once) before timing. Printed
as a table; `--json` saves every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

from jaxpd.bench.host import describe_host, host_line
from jaxpd.bench.args import positive_int
from jaxpd.bench.workers import start_all

TRANSPORTS = ("device_put", "transfer_server", "grpc")


def _ints(text: str) -> list[int]:
    return [positive_int(p) for p in text.split(",")]


def _parts(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a layer-wise transfer needs >= 2 parts, got {text!r}")
    return value


def _transports(text: str) -> list[str]:
    values = [p.strip() for p in text.split(",") if p.strip()]
    bad = [v for v in values if v not in TRANSPORTS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"transports must be among {','.join(TRANSPORTS)}, "
                                         f"got {text!r}")
    return values


RANDOM_FIELDS = {"hidden": "hidden_size", "layers": "num_hidden_layers",
                 "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
                 "head_dim": "head_dim", "mlp": "intermediate_size"}


def _random_spec(text: str) -> dict:
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in RANDOM_FIELDS or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"--random_model: expected key=int pairs with keys {sorted(RANDOM_FIELDS)}, "
                f"got {item!r}")
        out[RANDOM_FIELDS[key.strip()]] = int(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpd.bench.layerwise",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF checkpoint directory (default: the built-in model)")
    p.add_argument("--random_model", type=_random_spec,
                   help="instead of --model: random weights in the built-in model's shape "
                        "with these fields changed, e.g. hidden=512,layers=8,kv_heads=8")
    p.add_argument("--transports", type=_transports, default=list(TRANSPORTS))
    p.add_argument("--prompt_lens", type=_ints, default=[256, 512, 1000])
    p.add_argument("--repeats", type=positive_int, default=6,
                   help="timed requests per length and mode")
    p.add_argument("--parts", type=_parts, default=4, help="layer groups of a layer-wise transfer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="save every sample and the summary here")
    return p


# ---- the model ------------------------------------------------------------------------

def random_model_dir(fields: dict, path: str) -> str:
    """The built-in model's config with `fields` changed, random weights, same tokenizer."""
    from jaxpd.default_model import default_model_dir
    from jaxpd.models.config import ModelConfig
    from jaxpd.models.hf_io import save_hf_params
    from jaxpd.models.layout import init_params

    src = default_model_dir()
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    hf.update(fields)
    if "head_dim" not in fields:
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    if "intermediate_size" not in fields:
        hf["intermediate_size"] = 3 * hf["hidden_size"]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), path)
    cfg = ModelConfig.from_hf_dict(hf)
    save_hf_params(init_params(cfg, seed=0), cfg, path)
    return path


# ---- one deployment, two modes --------------------------------------------------------

def _frontends(transport: str, model: str, max_len: int, threshold: int, parts: int):
    """({"request": frontend, "layerwise": frontend}, close)."""
    common = dict(max_model_len=max_len, slots_per_shard=2, layerwise_parts=parts)
    if transport == "device_put":
        from jaxpd.llm import LLM
        # No compile-ahead: every timed request repeats the warm one's shapes.
        fronts = {mode: LLM(model, mesh="prefill=4,decode=4",
                            layerwise_min_tokens=t, **common)
                  for mode, t in (("request", 0), ("layerwise", threshold))}
        return fronts, lambda: [f.shutdown() for f in fronts.values()]
    from jaxpd.serving.router import Router, RouterConfig
    flags = ["--model", model, "--host", "127.0.0.1", "--port", "0", "--kv_transport", transport,
             "--nowarmup",
             "--max_model_len", str(max_len), "--layerwise_parts", str(parts)]
    children, (decode, request_level, layerwise) = start_all(
        [flags + ["--role", "decode", "--mesh", "decode=4", "--slots_per_shard", "2"]] +
        [flags + ["--role", "prefill", "--mesh", "prefill=4", "--layerwise_min_tokens", str(t)]
         for t in (0, threshold)])
    config = RouterConfig(max_model_len=max_len)
    fronts = {"request": Router(model, config, prefill=(request_level,), decode=(decode,)),
              "layerwise": Router(model, config, prefill=(layerwise,), decode=(decode,))}

    def close():
        for f in fronts.values():
            f.shutdown()
        for c in children:
            c.close()
    return fronts, close


def _one(front, prompt: list[int]) -> dict:
    from jaxpd.sampling_params import SamplingParams
    r = front.submit(front.make_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True)))
    for _ in front.events(r):
        pass
    out = front.completion(r)
    if out.finish_reason != "length" or len(r.timings.token_times) < 2:
        raise RuntimeError(f"request failed: {out.finish_reason} {r.abort_reason}")
    t = r.timings
    return {"ttft_ms": 1e3 * (t.token_times[0] - t.arrival),
            "t2t_ms": 1e3 * (t.token_times[1] - t.arrival),
            "gap_ms": 1e3 * (t.token_times[1] - t.token_times[0]),
            "tokens": list(out.token_ids)}


def measure(transport: str, model: str, prompt_lens: list[int], repeats: int, parts: int,
            seed: int, say=print) -> list[dict]:
    import numpy as np
    max_len = max(prompt_lens) + 8
    max_len = 1 << (max_len - 1).bit_length()
    threshold = max(16, 1 << (min(prompt_lens) - 1).bit_length())   # every timed bucket
    say(f"[{transport}] starting two deployments (layer-wise from {threshold} tokens, "
        f"{parts} parts)")
    fronts, close = _frontends(transport, model, max_len, threshold, parts)
    vocab = fronts["request"].model_config.vocab_size
    rng = np.random.default_rng(seed)
    rows = []
    try:
        for n in prompt_lens:
            prompts = [rng.integers(3, vocab, n).tolist() for _ in range(repeats)]
            for front in fronts.values():                     # warm: compile, connect
                _one(front, prompts[0])
            for i, prompt in enumerate(prompts):
                order = ("request", "layerwise") if i % 2 == 0 else ("layerwise", "request")
                got = {mode: _one(fronts[mode], prompt) for mode in order}
                if got["request"]["tokens"] != got["layerwise"]["tokens"]:
                    raise AssertionError(f"{transport}: layer-wise changed the tokens of a "
                                         f"{n}-token prompt")
                for mode, sample in got.items():
                    rows.append(dict(transport=transport, prompt_len=n, mode=mode,
                                     **{k: v for k, v in sample.items() if k != "tokens"}))
            say(f"[{transport}] {n} tokens done")
        _check_modes(transport, fronts, len(prompt_lens) * (repeats + 1))
    finally:
        close()
    return rows


def _check_modes(transport: str, fronts: dict, expected: int) -> None:
    """Refuse to report a comparison that did not happen: every request of the
    layer-wise deployment went layer-wise, none of the other's did."""
    if transport == "device_put":
        counts = {m: f.stats()["layerwise_transfers"] for m, f in fronts.items()}
    else:   # one decode worker behind both routers sees every transfer
        decode = fronts["layerwise"].stats()["workers"]["decode"]
        counts = {"request": 0, "layerwise": sum(w["layerwise_transfers"] for w in decode)}
    if counts != {"request": 0, "layerwise": expected}:
        raise AssertionError(f"{transport}: expected {expected} layer-wise transfers, all in "
                             f"the layer-wise deployment; got {counts}")


def summarize(rows: list[dict]) -> list[dict]:
    keys = sorted({(r["transport"], r["prompt_len"], r["mode"]) for r in rows},
                  key=lambda k: (TRANSPORTS.index(k[0]), k[1], k[2] != "request"))
    out = []
    for transport, n, mode in keys:
        mine = [r for r in rows if (r["transport"], r["prompt_len"], r["mode"]) == (transport, n, mode)]
        out.append({"transport": transport, "prompt_len": n, "mode": mode, "n": len(mine),
                    **{f"{m}_p50": statistics.median(r[f"{m}_ms"] for r in mine)
                       for m in ("ttft", "t2t", "gap")}})
    return out


def format_summary(summary: list[dict]) -> str:
    head = f"{'transport':<16}{'prompt':>7}  {'mode':<10}{'n':>3}{'TTFT p50':>11}{'T2T p50':>10}{'gap p50':>10}"
    lines = [head, "-" * len(head)]
    for s in summary:
        lines.append(f"{s['transport']:<16}{s['prompt_len']:>7}  {s['mode']:<10}{s['n']:>3}"
                     f"{s['ttft_p50']:>9.1f}ms{s['t2t_p50']:>8.1f}ms{s['gap_p50']:>8.1f}ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model and args.random_model:
        print("--model and --random_model exclude each other", file=sys.stderr)
        return 2
    from jaxpd.bench.driver import ensure_cpu_devices
    ensure_cpu_devices(8)                 # before jax starts: in-process runs need 8
    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    tmp = None
    model = args.model
    if args.random_model:
        tmp = tempfile.mkdtemp(prefix="jaxpd-bench-model-")
        model = random_model_dir(args.random_model, tmp)
    if model is None:
        from jaxpd.default_model import default_model_dir
        model = default_model_dir()
    try:
        rows = []
        for transport in args.transports:
            rows += measure(transport, model, args.prompt_lens, args.repeats, args.parts,
                            args.seed, say)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(rows)
    print(host_line(describe_host()))
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "summary": summary,
                       "samples": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
