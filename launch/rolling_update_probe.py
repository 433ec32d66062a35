"""`launch/rolling_update.sh` end to end under streaming load, every stream checked.

    python launch/rolling_update_probe.py [--model DIR] [--streams 4] [--max_tokens 24]
        [--max_model_len 128] [--json OUT.json]

v1 is `--model` (default: the built-in model); v2 a copy of it with layer 0's k_proj
weight negated (same shapes and tokenizer, other KV, other tokens). The recipe runs in
a subprocess; `--streams` clients stream greedy completions without pause through the
router from before v2 starts until after v1 is retired. Each stream's tokens must equal
one version's alone -- transformers' greedy tokens on that checkpoint -- and every
stream must finish. Prints a summary and exits 1 on any failed or mixed stream.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def negated_copy(src: str, dst: str, layer: int = 0) -> None:
    """`src` with layer `layer`'s k_proj weight negated, written as `dst`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    name = f"model.layers.{layer}.self_attn.k_proj.weight"
    weights[name] = -weights[name]
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def hf_tokens(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens (eos ignored) for each prompt."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="v1's checkpoint (default: built-in)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("--max_model_len", type=int, default=128)
    ap.add_argument("--drain_s", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import grpc
    from tokenizers import Tokenizer

    from jaxpd.default_model import default_model_dir
    from jaxpd.serving.proto import jaxpd_pb2, jaxpd_pb2_grpc

    old = os.path.abspath(a.model or default_model_dir())
    work = tempfile.mkdtemp(prefix="jaxpd-rolling-")
    new = os.path.join(work, "v2")
    negated_copy(old, new)
    tok = Tokenizer.from_file(os.path.join(old, "tokenizer.json"))
    texts = ["The list type", "A function returns", "In Python, a dict", "The loop ends"]
    prompts = [tok.encode(t).ids for t in texts]
    expected = {"v1": hf_tokens(old, prompts, a.max_tokens),
                "v2": hf_tokens(new, prompts, a.max_tokens)}
    assert all(x != y for x, y in zip(expected["v1"], expected["v2"])), "v2 must differ"

    port, internal, http = free_port(), free_port(), free_port()
    env = dict(os.environ, ROUTER_PORT=str(port), INTERNAL_PORT=str(internal),
               HTTP_PORT=str(http), MAX_MODEL_LEN=str(a.max_model_len),
               V1_DRAIN_S=str(a.drain_s))
    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rolling_update.sh")
    log = open(os.path.join(work, "recipe.log"), "w+")
    proc = subprocess.Popen(["bash", recipe, old, new], stdin=subprocess.PIPE, stdout=log,
                            stderr=subprocess.STDOUT, env=env, text=True,
                            start_new_session=True)
    done: list[tuple[int, list[int], str, str]] = []   # (prompt, tokens, finish, error)
    stop = threading.Event()
    events: dict[str, float] = {}
    start = time.monotonic()

    def recipe_said(text: str) -> bool:
        log.flush()
        with open(log.name) as f:
            return text in f.read()

    def wait_for(predicate, what: str, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not reached; recipe log {log.name}")
            time.sleep(0.2)
        events[what] = round(time.monotonic() - start, 1)

    def load(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = jaxpd_pb2_grpc.GenerationStub(channel)
            i = k
            while not stop.is_set():
                i = (i + 1) % len(prompts)
                request = jaxpd_pb2.GenerateRequest(
                    token_ids=jaxpd_pb2.TokenIds(ids=prompts[i]), max_tokens=a.max_tokens,
                    temperature=0.0, ignore_eos=True)
                tokens, finish, error = [], "", ""
                try:
                    for reply in stub.Generate(request, timeout=300):
                        tokens += reply.token_ids
                        if reply.HasField("finish_reason"):
                            finish = reply.finish_reason
                except grpc.RpcError as e:
                    error = f"{e.code().name}: {e.details()}"
                done.append((i, tokens, finish, error))

    clients = [threading.Thread(target=load, args=(k,), daemon=True)
               for k in range(a.streams)]
    try:
        wait_for(lambda: recipe_said("v1 starting"), "v1 starting")
        wait_for(lambda: _health(http).get("status") == "ok", "v1 serving")
        for c in clients:
            c.start()
        wait_for(lambda: len(done) >= 2 * a.streams, "v1 streams done")
        proc.stdin.write("\n")
        proc.stdin.flush()
        wait_for(lambda: recipe_said("new requests go to v2"), "v2 serving")
        switched = len(done)
        wait_for(lambda: recipe_said("v1 retired"), "v1 retired")
        retired = len(done)
        wait_for(lambda: len(done) >= retired + 2 * a.streams, "v2 streams done")
        stop.set()
        for c in clients:
            c.join(300)
        decode = _decode_info(log.name)
    finally:
        stop.set()
        for c in clients:
            if c.ident is not None:
                c.join(300)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    versions, failed, mixed = [], [], []
    for i, tokens, finish, error in done:
        if error or finish != "length":
            failed.append((i, tokens, finish, error))
            continue
        version = next((v for v in expected if expected[v][i] == tokens), None)
        (versions.append(version) if version else mixed.append((i, tokens)))
    result = {"streams": len(done), "failed": len(failed), "mixed": len(mixed),
              "v1": versions.count("v1"), "v2": versions.count("v2"),
              "finished_before_v2_served": switched, "finished_before_v1_retired": retired,
              "after_retired_all_v2": all(v == "v2" for v in versions[retired:]),
              "v2_decode_pages_free": [decode["free_pages"], decode["pages_total"]],
              "v2_decode_model_mismatches": decode["counters"]["handoffs_model_mismatch"],
              "events_s": events, "failures": failed[:5], "mixed_streams": mixed[:5],
              "recipe_log": log.name}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return int(bool(failed or mixed) or not result["v2"] or not result["v1"]
               or decode["free_pages"] != decode["pages_total"])


def _decode_info(recipe_log: str) -> dict:
    """Info of the last decode worker the recipe started (v2's), once idle."""
    import re

    from jaxpd.serving.role_rpc import RoleClient
    with open(recipe_log) as f:
        address = re.findall(r"decode worker on (\S+)", f.read())[-1]
    client = RoleClient(address)
    try:
        deadline = time.monotonic() + 30
        while True:
            info = client.info(timeout=10)
            if info["free_pages"] == info["pages_total"] or time.monotonic() > deadline:
                return info
            time.sleep(0.2)
    finally:
        client.close()


def _health(http_port: int) -> dict:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
