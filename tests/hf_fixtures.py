"""Tiny random Hugging Face checkpoints built locally with `transformers` (no hub).

torch and transformers are imported inside the functions: importing them takes seconds,
and most test modules that import this file only use them in slow tests."""
from __future__ import annotations

import os

# Several families and options: GQA, Llama 3 rope scaling, qwen2 q/k/v bias, mistral,
# tied embeddings, MHA with an explicit head_dim.
CONFIGS = {
    "llama_gqa": dict(model_type="llama", num_attention_heads=8, num_key_value_heads=2),
    "llama3_rope": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32},
                        rope_theta=500000.0),
    "qwen2_bias": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1,
                    sliding_window=None),
    "llama_tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4,
                       tie_word_embeddings=True, head_dim=24),
    # Newer families; their norms are randomised (`random_norms`) so that q/k norms and
    # Gemma's (1 + w) scales are exercised rather than left at their initial values.
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, random_norms=True),
    # Local layers see 8 tokens: prompts past that and decode steps cross the window.
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}},
                   random_norms=True),
    # Gemma 2: softcapped attention scores and logits, a global layer first.
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=1,
                   head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["full_attention", "sliding_attention"],
                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   random_norms=True, attn_implementation="eager"),
    # More experts than a mesh has devices; renormalised top 2.
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, random_norms=True),
    "mixtral": dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # What llama.cpp's GGUF files can hold (`tests/test_gguf_families.py`): it stores no
    # `query_pre_attn_scalar` (head_dim is assumed), no layer types (gemma2 alternates
    # from a local layer 0; gemma3 has every sixth layer global: build it with 6
    # layers), and no dense layer in a Qwen mixture of experts.
    "gemma2_gguf": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                        random_norms=True, attn_implementation="eager"),
    "gemma3_gguf": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear",
                                                            "factor": 4.0,
                                                            "rope_theta": 1000000.0}},
                        random_norms=True),
    "qwen2_moe_gguf": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2,
                           num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, norm_topk_prob=False),
    # Fewer experts than devices, top 1 not renormalised, a shared expert, and layer 1
    # dense (`mlp_only_layers`).
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2,
                      num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      mlp_only_layers=[1]),
}


def build_hf_model(name: str, path: str, vocab_size: int = 256, hidden_size: int = 64,
                   num_layers: int = 2, seed: int = 0, max_position_embeddings: int = 512):
    """Create, save (`save_pretrained`) and return a tiny random HF model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(CONFIGS[name])
    model_type = spec.pop("model_type")
    random_norms = spec.pop("random_norms", False)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2,
        # Larger than the usual 0.02 so greedy argmaxes are decisive (no float near-ties).
        initializer_range=0.15, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if random_norms:
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.3)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation from transformers' `generate`."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()
