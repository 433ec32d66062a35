"""Decode attention cores on this machine's device: each compiled kernel against the jnp
reference (max abs error) and timed (median of `--iters` calls), at 1B-8B-class shapes.

    python3 launch/attention_bench.py [--json OUT.json] [--impls reference,pallas_gpu]

On CPU, `--interpret` checks the script itself with the kernels interpreted (slow; tiny
shapes via `--batches 2 --contexts 64`).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.config import resolve_attention_impl
from jaxpd.models.pallas_attention import decode_attention


def _inputs(b, context, *, n, kh, h, page_size, dtype, seed=0):
    """B slots of `context` tokens each on distinct random pages (+ the null page 0)."""
    pages_per_slot = -(-context // page_size)
    num_pages = b * pages_per_slot + 1
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (b, n, h), dtype)
    k = jax.random.normal(keys[1], (num_pages, page_size, kh, h), dtype)
    v = jax.random.normal(keys[2], (num_pages, page_size, kh, h), dtype)
    tables = (rng.permutation(num_pages - 1) + 1).reshape(b, pages_per_slot)
    lengths = np.full(b, context, np.int32)
    lengths[0] = max(1, context // 3)               # one ragged slot
    return q, k, v, jnp.asarray(tables, jnp.int32), jnp.asarray(lengths)


def _one_layer(attention):
    """Every core with the reference's signature: a whole-pool kernel (`native`) gets
    the [P, ...] pools as one layer."""
    if not getattr(attention, "whole_pool", False):
        return attention
    return lambda q, k, v, tables, lengths: attention(q, k[None], v[None], 0, tables, lengths)


def _median_s(fn, args, iters):
    fn(*args).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="reference,auto")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    platform = jax.devices()[0].platform
    impls = []
    for name in a.impls.split(","):
        impl = resolve_attention_impl(name, platform, a.interpret and name != "reference",
                                      a.dtype)
        if impl not in impls:
            impls.append(impl)
    fns = {i: jax.jit(_one_layer(decode_attention(i, a.interpret and i != "reference")))
           for i in impls}
    rows = []
    print(f"{platform}: N={a.heads} K={a.kv_heads} H={a.head_dim} page_size={a.page_size} "
          f"{a.dtype}")
    print(f"{'impl':<12}{'B':>5}{'context':>9}{'us':>10}{'GB/s':>8}{'max_err':>10}")
    for b in map(int, a.batches.split(",")):
        for context in map(int, a.contexts.split(",")):
            args = _inputs(b, context, n=a.heads, kh=a.kv_heads, h=a.head_dim,
                           page_size=a.page_size, dtype=jnp.dtype(a.dtype))
            expected = np.asarray(fns[impls[0]](*args), np.float32)
            kv_bytes = 2 * b * context * a.kv_heads * a.head_dim * jnp.dtype(a.dtype).itemsize
            for impl, fn in fns.items():
                err = float(np.abs(np.asarray(fn(*args), np.float32) - expected).max())
                seconds = _median_s(fn, args, a.iters)
                row = dict(impl=impl, batch=b, context=context, us=seconds * 1e6,
                           gb_per_s=kv_bytes / seconds / 1e9, max_err=err)
                rows.append(row)
                print(f"{impl:<12}{b:>5}{context:>9}{row['us']:>10.1f}{row['gb_per_s']:>8.1f}"
                      f"{err:>10.2e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(platform=platform, args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
