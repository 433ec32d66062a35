"""A tiny random Llama checkpoint written with numpy and safetensors (no torch): for
tests that need a model of a given head dim and GQA ratio but not its numbers."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file


def write_random_llama(path: str, head_dim: int, num_heads: int = 4, num_kv_heads: int = 2,
                       hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 256,
                       max_position_embeddings: int = 512, seed: int = 0) -> str:
    """A Hugging Face Llama directory (config.json, model.safetensors) at `path`."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    d, h, f = hidden_size, head_dim, 2 * hidden_size
    tensors = {"model.embed_tokens.weight": w(vocab_size, d), "model.norm.weight": np.ones(d, np.float32),
               "lm_head.weight": w(vocab_size, d)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.input_layernorm.weight": np.ones(d, np.float32),
                    f"{p}.post_attention_layernorm.weight": np.ones(d, np.float32),
                    f"{p}.self_attn.q_proj.weight": w(num_heads * h, d),
                    f"{p}.self_attn.k_proj.weight": w(num_kv_heads * h, d),
                    f"{p}.self_attn.v_proj.weight": w(num_kv_heads * h, d),
                    f"{p}.self_attn.o_proj.weight": w(d, num_heads * h),
                    f"{p}.mlp.gate_proj.weight": w(f, d), f"{p}.mlp.up_proj.weight": w(f, d),
                    f"{p}.mlp.down_proj.weight": w(d, f)}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": vocab_size, "hidden_size": d, "intermediate_size": f,
              "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
              "num_key_value_heads": num_kv_heads, "head_dim": h, "hidden_act": "silu",
              "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return path
