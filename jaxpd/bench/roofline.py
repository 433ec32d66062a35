"""`python -m jaxpd.bench --roofline`: how close prefill and decode come to this machine's bounds.

Measured in one run, on one device (`jax.devices()[0]`):
- memory bandwidth: the best of a 256 MiB float32 reduction (`sum`, reads every byte
  once) and a scaled copy (`x * a`, reads and writes every byte), bytes moved / time;
- matmul rate: a float32 2048 x 2048 x 2048 matmul, 2 n^3 FLOPs / time.
Then the model's own jitted `Llama.prefill` (batch 1, every length bucket) and
`Llama.decode` (each batch size x context length, pools donated as in the engine):
- FLOPs  = 2 x (per-token matmul weights) x tokens + attention + the last-token logits.
  Attention counts 4 x T x S x N x H per layer (QK^T and PV); the jnp reference computes
  the full T x T block under a mask, so prefill counts S = T, not the causal half.
- bytes  = every weight once (at its stored size: `--quantization` counts quantized
  bytes, `models.quant.step_bytes`) + the KV a step reads (2 x L x B x context x K x H
  x 4 B) + the KV a step or prompt writes.
The roofline bound of a call is max(FLOPs / matmul rate, bytes / bandwidth); the
fraction printed is bound / measured time (1.0 = at the roofline), and `limit` says
which side binds. Decode is expected to be memory-bound and prefill compute-bound
on accelerators; on a CPU, where FLOP/s per byte/s is low, small decode batches can
still be compute- or overhead-bound: the table shows which.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np

from jaxpd.bench.host import host_line
from jaxpd.bench.args import describe_devices, positive_floats, positive_int


def add_roofline_flags(p: argparse.ArgumentParser) -> None:
    """The `--roofline` group of `python -m jaxpd.bench`'s flags."""
    r = p.add_argument_group("roofline")
    r.add_argument("--roofline", action="store_true",
                   help="instead of serving: measure bandwidth and matmul rate, then time "
                        "prefill per bucket and decode steps against those bounds")
    r.add_argument("--roofline_batches", type=positive_floats, default=[1, 4, 16],
                   help="decode batch sizes timed by --roofline")
    r.add_argument("--roofline_contexts", type=positive_floats, default=[128, 512],
                   help="decode context lengths timed by --roofline")
    r.add_argument("--roofline_max_len", type=positive_int, default=1024,
                   help="longest prefill bucket timed by --roofline (capped by the model)")
    r.add_argument("--roofline_repeats", type=positive_int, default=5,
                   help="timed calls per shape (the best one counts)")


_BANDWIDTH_ELEMENTS = 64 << 20          # 256 MiB of float32
_MATMUL_N = 2048
_BYTES = 4                               # float32 everywhere here


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls of `fn` (blocking), after one unmeasured call."""
    import jax
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(repeats: int = 5) -> dict:
    """Bytes/s of a reduction and of a scaled copy over a 256 MiB array."""
    import jax
    import jax.numpy as jnp
    x = jax.block_until_ready(jnp.ones(_BANDWIDTH_ELEMENTS, jnp.float32))
    nbytes = _BANDWIDTH_ELEMENTS * _BYTES
    reduce, scale = jax.jit(jnp.sum), jax.jit(lambda a: a * 1.0001)
    read_s = best_time(lambda: reduce(x), repeats)
    copy_s = best_time(lambda: scale(x), repeats)
    read, copy = nbytes / read_s, 2 * nbytes / copy_s
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy, "bytes_per_s": max(read, copy)}


def measure_matmul(repeats: int = 3) -> dict:
    """FLOP/s of a float32 n x n x n matmul."""
    import jax
    import jax.numpy as jnp
    n = _MATMUL_N
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    seconds = best_time(lambda: matmul(a, b), repeats)
    return {"n": n, "flops_per_s": 2 * n ** 3 / seconds}


def _matmul_params_per_token(cfg) -> int:
    """Matmul weights one token multiplies, over every layer (a sparse layer's router,
    its top-k experts and shared expert only)."""
    d, h = cfg.hidden_size, cfg.head_dim
    attn = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    total = 0
    for i in range(cfg.num_layers):
        if cfg.is_sparse(i):
            mlp = (d * cfg.num_experts + 3 * d * cfg.shared_expert_intermediate_size
                   + cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size)
        else:
            mlp = 3 * d * cfg.intermediate_size
        total += attn + mlp
    return total


def experts_touched(cfg, tokens: int) -> float:
    """Experts a sparse layer expects to read for `tokens` tokens routed uniformly at
    random, k each: E * (1 - (1 - k/E) ** tokens); k for one token, E for many."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens) if e else 0.0


def read_weight_bytes(cfg, tokens: int) -> float:
    """Weight bytes a call over `tokens` tokens reads: every dense weight, and of a
    sparse layer's experts only those some token was routed to (`experts_touched`)."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_layers))
    unread = sparse * (cfg.num_experts - experts_touched(cfg, tokens)) * expert
    return (cfg.num_params - unread) * _BYTES


def prefill_cost(cfg, batch: int, length: int, weight_bytes: int | None = None
                 ) -> tuple[float, float]:
    """(FLOPs, bytes) of one prefill call of `batch` prompts padded to `length`;
    `weight_bytes`: the weights' stored bytes (default: float32)."""
    tokens = batch * length
    flops = 2 * _matmul_params_per_token(cfg) * tokens
    flops += 4 * cfg.num_layers * batch * length * length * cfg.num_heads * cfg.head_dim
    flops += 2 * batch * cfg.hidden_size * cfg.vocab_size           # last-token logits
    kv_written = 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * _BYTES
    return float(flops), float(_read(cfg, tokens, weight_bytes) + kv_written)


def decode_cost(cfg, batch: int, context: int, weight_bytes: int | None = None
                ) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of `batch` slots, each attending `context`
    tokens; a mixture of experts reads only the experts its batch is routed to;
    `weight_bytes`: the weights' stored bytes (default: float32)."""
    flops = 2 * batch * (_matmul_params_per_token(cfg) + cfg.hidden_size * cfg.vocab_size)
    flops += 4 * cfg.num_layers * batch * context * cfg.num_heads * cfg.head_dim
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _BYTES
    return float(flops), float(_read(cfg, batch, weight_bytes)
                               + kv_per_token * batch * (context + 1))


def _read(cfg, tokens: int, stored: int | None) -> float:
    """Weight bytes a call over `tokens` tokens reads, of `stored` bytes in all (None:
    float32): the routed experts' share (`read_weight_bytes`) of what is stored."""
    read = read_weight_bytes(cfg, tokens)
    return read if stored is None else stored * read / (cfg.num_params * _BYTES)


def _row(kind: str, shape: dict, flops: float, nbytes: float, seconds: float,
         machine: dict) -> dict:
    compute_s = flops / machine["flops_per_s"]
    memory_s = nbytes / machine["bytes_per_s"]
    bound = max(compute_s, memory_s)
    return {"kind": kind, **shape, "flops": flops, "bytes": nbytes, "measured_s": seconds,
            "compute_bound_s": compute_s, "memory_bound_s": memory_s,
            "limit": "compute" if compute_s >= memory_s else "memory",
            "fraction_of_roofline": bound / seconds,
            "achieved_flops_per_s": flops / seconds, "achieved_bytes_per_s": nbytes / seconds}


def time_prefill(cfg, params, length: int, repeats: int,
                 attention_impl: str = "reference") -> float:
    """Best time of one prompt's prefill, its attention as the engine's prefill runs it
    on one device for a resolved `attention_impl` (`engine.programs.kernels.prefill_attention`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jaxpd.engine.programs.kernels import prefill_attention
    from jaxpd.models.llama import Llama
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    model = Llama(cfg, prefill_attention=prefill_attention(attention_impl, mesh, (),
                                                           cfg.head_dim))
    fn = jax.jit(lambda p, t, n: model.apply({"params": p}, t, n, method=Llama.prefill))
    tokens = jnp.full((1, length), 3, jnp.int32)
    lengths = jnp.array([length], jnp.int32)
    return best_time(lambda: fn(params, tokens, lengths), repeats)


def time_decode(cfg, params, batch: int, context: int, page_size: int, repeats: int,
                attention_impl: str = "reference", qmatmul=None) -> float:
    """Best step time with `batch` slots whose next token sits at position `context`;
    `params`: `fuse_params`'s tree, as decode meshes run them; `qmatmul`: the product of
    quantized weights, as `Engine._quant_matmul` picks it."""
    import jax
    import jax.numpy as jnp
    from jaxpd.engine.programs.experts import decode_experts
    from jaxpd.models.llama import Llama
    from jaxpd.models.pallas_attention import decode_attention
    # Experts as a decode mesh of one device runs them (kept ones through `qmatmul`).
    model = Llama(cfg, fused=True, decode_attention=decode_attention(attention_impl),
                  experts=decode_experts((), qmatmul), qmatmul=qmatmul)
    pages_per_slot = -(-(context + 1) // page_size)
    shape = (cfg.num_layers, batch * pages_per_slot + 1, page_size, cfg.num_kv_heads,
             cfg.head_dim)
    pools = [jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)]
    tables = jnp.asarray(1 + np.arange(batch * pages_per_slot, dtype=np.int32)
                         .reshape(batch, pages_per_slot))
    tokens = jnp.full((batch,), 3, jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    step = jax.jit(lambda p, t, pos, k, v, bt: model.apply(
        {"params": p}, t, pos, k, v, bt, method=Llama.decode), donate_argnums=(3, 4))

    def call():
        # Donated pools come back updated, as in the engine: no copy per step.
        logits, pools[0], pools[1] = step(params, tokens, positions, pools[0], pools[1], tables)
        return logits
    return best_time(call, repeats)


def format_roofline(machine: dict, rows: list[dict]) -> str:
    """A plain-text table of the measured machine and every timed shape."""
    lines = [f"memory bandwidth: {machine['bytes_per_s'] / 1e9:.2f} GB/s "
             f"(read {machine['read_bytes_per_s'] / 1e9:.2f}, copy "
             f"{machine['copy_bytes_per_s'] / 1e9:.2f})",
             f"matmul rate:      {machine['flops_per_s'] / 1e9:.2f} GFLOP/s "
             f"(float32 {machine['matmul_n']}^3)", "",
             f"{'call':<8}{'batch':>6}{'tokens':>8}{'measured ms':>13}{'compute ms':>12}"
             f"{'memory ms':>11}{'limit':>9}{'GFLOP/s':>9}{'GB/s':>7}{'of roofline':>13}"]
    for r in rows:
        tokens = r["length"] if r["kind"] == "prefill" else r["context"]
        lines.append(f"{r['kind']:<8}{r['batch']:>6}{tokens:>8}{r['measured_s'] * 1e3:>13.2f}"
                     f"{r['compute_bound_s'] * 1e3:>12.2f}{r['memory_bound_s'] * 1e3:>11.2f}"
                     f"{r['limit']:>9}{r['achieved_flops_per_s'] / 1e9:>9.1f}"
                     f"{r['achieved_bytes_per_s'] / 1e9:>7.1f}"
                     f"{100 * r['fraction_of_roofline']:>12.1f}%")
    lines.append("(tokens: prompt bucket for prefill, context length for decode; decode "
                 f"attention: {machine['decode_attention']}; prefill attention: "
                 f"{machine['prefill_attention']})")
    return "\n".join(lines)


def run_roofline(model_dir: str, args: argparse.Namespace) -> dict:
    """Measure the machine, time the model's calls, print the table, write --json."""
    import jax
    from jaxpd.config import resolve_attention_impl
    from jaxpd.engine.scheduling.buckets import length_buckets
    from jaxpd.models import checkpoint
    from jaxpd.models.layout import fuse_params

    from jaxpd.models import quant
    loaded = checkpoint.load(model_dir, dtype="float32",
                             quantization=getattr(args, "quantization", "none"))
    cfg = loaded.cfg
    device = jax.devices()[0]
    params = jax.device_put(loaded.params, device)
    fused = jax.device_put(fuse_params(cfg, loaded.params), device)   # as decode meshes run
    bandwidth = measure_bandwidth(args.roofline_repeats)
    matmul = measure_matmul(min(args.roofline_repeats, 3))
    # Decode steps and prefills run the attention cores the engine would serve with here.
    attention = resolve_attention_impl(args.attention_impl, device.platform)
    from jaxpd.models import native_attention
    native_prefill = attention == "native" and native_attention.prefill_available(cfg.head_dim)
    machine = {**bandwidth, "flops_per_s": matmul["flops_per_s"], "matmul_n": matmul["n"],
               "decode_attention": attention,
               "prefill_attention": "native" if native_prefill else "reference"}
    machine["weights"] = loaded.quantization
    step_bytes = quant.step_bytes(params, cfg.tie_word_embeddings)
    qmatmul = (quant.native_matmul if quant.any_quantized(params) and device.platform == "cpu"
               and quant.native_available() else None)
    rows = []
    max_len = min(args.roofline_max_len, cfg.max_position_embeddings)
    for length in length_buckets(max_len):
        if length > cfg.max_position_embeddings:
            break
        seconds = time_prefill(cfg, params, length, args.roofline_repeats, attention)
        rows.append(_row("prefill", {"batch": 1, "length": length},
                         *prefill_cost(cfg, 1, length, quant.weight_bytes(params)), seconds,
                         machine))
    for batch in args.roofline_batches:
        for context in args.roofline_contexts:
            if context + 1 > cfg.max_position_embeddings:
                continue
            seconds = time_decode(cfg, fused, batch, context, 16, args.roofline_repeats,
                                  attention, qmatmul)
            rows.append(_row("decode", {"batch": batch, "context": context},
                             *decode_cost(cfg, batch, context, step_bytes), seconds, machine))
    result = {"machine": machine, "rows": rows, "model": model_dir,
              "num_params": cfg.num_params, "num_active_params": cfg.num_active_params,
              "device": describe_devices()}
    print(host_line(result["device"]["host"]))
    print(format_roofline(machine, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
