"""One long prompt through a warmed-up engine at a long context, against transformers.

    python launch/long_prompt_probe.py [--model smollm2-135m-instruct] [--max_model_len 8192]
        [--prompt_len 6000] [--new_tokens 32] [--no_hf_tokens] [--json OUT.json]

Prints a table and saves JSON: warm-up time (SERVING), the time until the long-prompt
programs compiling in the background are ready too, the programs compiled, compiles while
serving (none expected), cold and repeated TTFT (the prefix cache), the first request's
inter-token gaps, transformers' single forward pass over the prompt, and whether the
greedy tokens equal transformers' (`--no_hf_tokens` skips its slow generate).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--mesh", default="prefill=1,decode=1")
    ap.add_argument("--max_model_len", type=int, default=8192)
    ap.add_argument("--prompt_len", type=int, default=6000)
    ap.add_argument("--new_tokens", type=int, default=32)
    ap.add_argument("--no_hf_tokens", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from jaxpd import LLM, SamplingParams
    from jaxpd.engine.compile.background import settle
    from jaxpd.model_registry import resolve_model

    path = resolve_model(a.model)
    start = time.perf_counter()
    llm = LLM(a.model, mesh=a.mesh, max_model_len=a.max_model_len, warmup=True)
    warmup_s = time.perf_counter() - start
    settle(llm.engine, 900)     # long-prompt chunks compile in the background
    chunks_ready_s = time.perf_counter() - start
    programs = llm.engine.counter.counts()
    vocab = llm.model_config.vocab_size
    prompt = np.random.default_rng(0).integers(100, vocab - 1, size=a.prompt_len).tolist()
    params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    cold = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    repeat = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    after = llm.engine.counter.counts()
    llm.shutdown()

    import torch
    from transformers import AutoModelForCausalLM
    kwargs = ({"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {})
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path) if kwargs else path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        hf(ids)
        hf_forward_s = time.perf_counter() - t
        same = None
        if not a.no_hf_tokens:
            ref = hf.generate(ids, do_sample=False, max_new_tokens=a.new_tokens,
                              min_new_tokens=a.new_tokens, eos_token_id=None, pad_token_id=0)
            same = cold.token_ids == ref[0, a.prompt_len:].tolist()
    itl = cold.metrics.itl_s
    result = {
        "model": a.model, "mesh": a.mesh, "max_model_len": a.max_model_len,
        "prompt_len": a.prompt_len, "warmup_s": warmup_s, "chunks_ready_s": chunks_ready_s,
        "programs": programs,
        "compiles_while_serving": {k: after[k] - programs.get(k, 0) for k in after
                                   if after[k] != programs.get(k, 0)},
        "ttft_cold_s": cold.metrics.ttft_s, "ttft_repeat_s": repeat.metrics.ttft_s,
        "itl_median_s": float(np.median(itl)), "itl_max_s": max(itl),
        "itl_max_index": int(np.argmax(itl)), "itl_s": list(itl),
        "hf_forward_s": hf_forward_s, "tokens_equal_hf": same,
        "repeat_equal": repeat.token_ids == cold.token_ids}
    rows = [("warm-up s", f"{warmup_s:.1f}"), ("long-prompt programs ready s",
                                                f"{chunks_ready_s:.1f}"),
            ("programs", str(sum(programs.values()))),
            ("compiles while serving", str(sum(result["compiles_while_serving"].values()))),
            ("TTFT cold s", f"{result['ttft_cold_s']:.2f}"),
            ("TTFT repeat s", f"{result['ttft_repeat_s']:.2f}"),
            ("transformers forward s", f"{hf_forward_s:.2f}"),
            ("cold TTFT / forward", f"{result['ttft_cold_s'] / hf_forward_s:.2f}x"),
            ("ITL median / max ms", f"{1e3 * result['itl_median_s']:.0f} / "
                                    f"{1e3 * result['itl_max_s']:.0f} "
                                    f"(gap {result['itl_max_index'] + 1})"),
            ("greedy tokens == transformers", str(same))]
    for name, value in rows:
        print(f"{name:<32}{value}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
