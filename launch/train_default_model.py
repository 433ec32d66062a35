"""Train the built-in default model (`jaxpd/default_model/`) on CPU, with no network.

    PYTHONPATH=. python launch/train_default_model.py --out jaxpd/default_model

Builds the corpus and tokenizer of `launch/default_corpus.py`, trains a ~6M-parameter
Llama (GQA, tied embeddings) with AdamW, warmup + cosine decay and gradient clipping on
random 256-token windows, then writes a Hugging Face checkpoint: config.json,
bfloat16 model.safetensors, the tokenizer files, generation_config.json, the word list
the tests check generated text against, and training_log.json (loss curve, wall time,
final losses and sample completions).

Training keeps float32 master weights and computes in bfloat16: on a CPU with AMX
that is what makes the step fast enough. Without `--steps`, the script times a few
steps first and sizes the run (and its cosine schedule) to `--time-budget-min`; it also
stops at the budget whatever `--steps` says, which the log records.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from launch import default_corpus
from jaxpd.models import checkpoint
from jaxpd.models.config import ModelConfig
from jaxpd.models.hf_io import save_hf_params
from jaxpd.models.layout import init_params
from jaxpd.models.llama import Llama

NUM_EVALS = 20                 # points on the validation curve
NUM_EVAL_WINDOWS = 64          # fixed windows each periodic evaluation scores
EVAL_CHUNK = 16                # windows per eval forward
RESERVE_S = 120.0              # budget kept for the final evaluation, saving and samples
SAMPLE_PROMPTS = ("The list type", "Return the", "import")
SAMPLE_TOKENS = 32
WORDS_FILE = "corpus_words.txt"


def model_config(vocab_size: int) -> ModelConfig:
    """6 layers, D=256, 8 query / 4 kv heads, F=768, tied embeddings: ~5.8M parameters."""
    return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=256,
                       intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=4,
                       head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_ids=(2,))


def hf_config(cfg: ModelConfig, pad_id: int) -> dict:
    """The `config.json` transformers' LlamaForCausalLM reads for `cfg`."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings, "initializer_range": 0.02,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "pad_token_id": pad_id, "use_cache": True,
        # transformers < 5 reads torch_dtype, >= 5 reads dtype.
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }


def windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` evenly spaced, non-overlapping [seq_len + 1] windows (all when count <= 0)."""
    num = (len(stream) - 1) // seq_len
    starts = np.arange(num) * seq_len
    if 0 < count < num:
        starts = starts[np.linspace(0, num - 1, count).round().astype(int)]
    return np.stack([stream[s:s + seq_len + 1] for s in starts])


def make_optimizer(steps: int, lr: float, warmup: int, weight_decay: float, clip: float):
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.1)
    # Decay matrices only: norm scales pull towards 1, not 0.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                   mask=decay_mask)), schedule


def loss_fn(model: Llama, params, batch_BT1, compute_dtype):
    """Mean next-token cross-entropy of [B, T+1] windows."""
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    logits = model.apply({"params": params}, batch_BT1[:, :-1], method=Llama.forward)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch_BT1[:, 1:]).mean()


def evaluate(eval_fn, params, windows_WT1: np.ndarray) -> float:
    losses = [float(eval_fn(params, jnp.asarray(windows_WT1[i:i + EVAL_CHUNK])))
              for i in range(0, len(windows_WT1), EVAL_CHUNK)]
    sizes = [len(windows_WT1[i:i + EVAL_CHUNK]) for i in range(0, len(windows_WT1), EVAL_CHUNK)]
    return float(np.average(losses, weights=sizes))


def generate(cfg: ModelConfig, params, prompt: list[int], num_new: int,
             temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Greedy (temperature 0) or sampled continuation by full forwards over a fixed buffer
    (one compile: causal attention makes the padding after the tokens irrelevant).
    Stops after an EOS token, as the engine and transformers' `generate` do."""
    model, size = Llama(cfg), len(prompt) + num_new
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, method=Llama.forward)[0])
    tokens = np.zeros((1, size), np.int32)
    tokens[0, :len(prompt)] = prompt
    key = jax.random.PRNGKey(seed)
    for pos in range(len(prompt), size):
        logits = forward(params, jnp.asarray(tokens))[pos - 1]
        if temperature > 0:
            key, sub = jax.random.split(key)
            tokens[0, pos] = int(jax.random.categorical(sub, logits / temperature))
        else:
            tokens[0, pos] = int(jnp.argmax(logits))
        if tokens[0, pos] in cfg.eos_token_ids:
            return tokens[0, len(prompt):pos + 1].tolist()
    return tokens[0, len(prompt):].tolist()


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the built-in default model.")
    p.add_argument("--out", default="jaxpd/default_model", help="checkpoint directory")
    p.add_argument("--steps", type=int, default=0, help="0: size the run to the time budget")
    p.add_argument("--time-budget-min", type=float, default=25.0,
                   help="wall-clock budget of the whole script, in minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    start = time.time()
    deadline = start + args.time_budget_min * 60
    log = lambda msg: print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    corpus = default_corpus.build_corpus()
    tok = default_corpus.train_tokenizer(corpus.train)
    train_stream = np.asarray(default_corpus.encode_stream(tok, corpus.train), np.int32)
    val_stream = np.asarray(default_corpus.encode_stream(tok, corpus.val), np.int32)
    corpus_stats = {"python": sys.version.split()[0], "docs_train": len(corpus.train),
                    "docs_val": len(corpus.val),
                    "chars_train": sum(map(len, corpus.train)),
                    "chars_val": sum(map(len, corpus.val)),
                    "tokens_train": int(len(train_stream)), "tokens_val": int(len(val_stream))}
    log(f"corpus {corpus_stats}")

    cfg = model_config(tok.get_vocab_size())
    model = Llama(cfg)
    params = init_params(cfg, seed=args.seed)
    eval_windows = windows(val_stream, args.seq_len, NUM_EVAL_WINDOWS)
    rng = np.random.default_rng(args.seed)

    def sample_batch():
        starts = rng.integers(0, len(train_stream) - args.seq_len - 1, size=args.batch_size)
        return jnp.asarray(np.stack([train_stream[s:s + args.seq_len + 1] for s in starts]))

    eval_bf16 = jax.jit(lambda p, w: loss_fn(model, p, w, jnp.bfloat16))
    eval_f32 = jax.jit(lambda p, w: loss_fn(model, p, w, jnp.float32))

    def build_step(steps):
        opt, schedule = make_optimizer(steps, args.lr, max(1, int(steps * args.warmup_frac)),
                                       args.weight_decay, args.clip)

        @jax.jit
        def train_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, batch, jnp.bfloat16)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return opt, schedule, train_step

    steps = args.steps
    if steps <= 0:
        # Time a few throwaway steps (and one evaluation) to size the run to the budget.
        opt, _, train_step = build_step(1000)
        state = opt.init(params)
        batch = sample_batch()
        jax.block_until_ready(train_step(params, state, batch))
        t0 = time.time()
        for _ in range(3):
            jax.block_until_ready(train_step(params, state, batch))
        step_s = (time.time() - t0) / 3
        evaluate(eval_bf16, params, eval_windows)
        t0 = time.time()
        evaluate(eval_bf16, params, eval_windows)
        eval_s = time.time() - t0
        remaining = deadline - time.time() - RESERVE_S - NUM_EVALS * eval_s
        # 10% slack: the machine is shared, and the step time moves with its load.
        steps = max(10, int(0.9 * remaining / step_s))
        log(f"calibration: {step_s:.2f} s/step, {eval_s:.1f} s/eval -> {steps} steps")

    opt, schedule, train_step = build_step(steps)
    opt_state = opt.init(params)
    eval_every = max(1, steps // NUM_EVALS)
    curve, window_losses, stopped_early, step = [], [], False, 0
    train_start = time.time()
    for step in range(1, steps + 1):
        params, opt_state, loss = train_step(params, opt_state, sample_batch())
        window_losses.append(loss)
        if step % eval_every == 0 or step == steps:
            train_loss = float(np.mean(jax.device_get(window_losses)))
            window_losses = []
            val_loss = evaluate(eval_bf16, params, eval_windows)
            curve.append({"step": step, "train_loss": train_loss, "val_loss": val_loss,
                          "lr": float(schedule(step)), "wall_s": round(time.time() - start, 1)})
            log(f"step {step}/{steps} train {train_loss:.3f} val {val_loss:.3f} "
                f"({(time.time() - train_start) / step:.2f} s/step)")
            if time.time() > deadline - RESERVE_S and step < steps:
                stopped_early = True
                log(f"time budget reached: stopping at step {step} of {steps}")
                break
    train_s = time.time() - train_start

    # Score what ships: weights rounded to bfloat16, computed in float32 as jaxpd serves them.
    shipped = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    final_val = evaluate(eval_f32, shipped, windows(val_stream, args.seq_len, 0))
    final_train = evaluate(eval_f32, shipped, windows(train_stream, args.seq_len, 4 * NUM_EVAL_WINDOWS))
    log(f"final (bf16 weights): train {final_train:.3f} val {final_val:.3f} "
        f"ppl {math.exp(final_val):.1f}")

    out = args.out
    os.makedirs(out, exist_ok=True)
    default_corpus.save_tokenizer(tok, out, max_length=cfg.max_position_embeddings)
    pad_id = tok.token_to_id(default_corpus.PAD)
    write_json(os.path.join(out, "config.json"), hf_config(cfg, pad_id))
    write_json(os.path.join(out, "generation_config.json"),
               {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
                "pad_token_id": pad_id})
    save_hf_params(params, cfg, out, dtype="bfloat16")
    # safetensors writes the file owner-only; a package file must be readable by all.
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    with open(os.path.join(out, WORDS_FILE), "w") as f:
        f.write("\n".join(default_corpus.corpus_words(corpus.train)) + "\n")

    # Samples from the checkpoint as written, through the same loader the engine uses.
    loaded = checkpoint.load(out, dtype="float32")
    samples = []
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        ids = loaded.tokenizer.encode(prompt)
        greedy = generate(loaded.cfg, loaded.params, ids, SAMPLE_TOKENS)
        sampled = generate(loaded.cfg, loaded.params, ids, SAMPLE_TOKENS, 0.8, seed=args.seed + i)
        samples.append({"prompt": prompt, "greedy": loaded.tokenizer.decode(greedy),
                        "temperature_0.8": loaded.tokenizer.decode(sampled)})
        log(f"sample {samples[-1]}")

    write_json(os.path.join(out, "training_log.json"), {
        "command": " ".join(["python"] + sys.argv),
        "args": vars(args),
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__,
                     "optax": optax.__version__},
        "device": str(jax.devices()[0].device_kind),
        "num_params": cfg.num_params,
        "corpus": corpus_stats,
        "steps_planned": steps, "steps_done": step, "stopped_early": stopped_early,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "train_wall_s": round(train_s, 1), "total_wall_s": round(time.time() - start, 1),
        "final_train_loss": final_train, "final_val_loss": final_val,
        "final_val_perplexity": math.exp(final_val),
        "loss_curve": curve,
        "samples": samples,
    })
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
