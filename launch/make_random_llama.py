"""Write a Llama checkpoint with random weights in Hugging Face format (safetensors +
config.json, no tokenizer): a stand-in of a given size where no weights can be fetched.

    python launch/make_random_llama.py OUT_DIR [--size 1b|135m|tiny|tiny_h128] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

SIZES = {
    # ~1.2B parameters: the shape class of Llama-3.2-1B (16 layers, d 2048, GQA 32/8).
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # SmolLM2-135M's shape (30 layers, d 576, 9/3 heads, vocab 49152, tied embeddings).
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                 tie_word_embeddings=True),
    # Head dim 128 (4 heads of d 512), the TPU kernel's lane width, in a tiny model.
    "tiny_h128": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--max_position_embeddings", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(**SIZES[args.size], max_position_embeddings=args.max_position_embeddings,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote a random {args.size} Llama ({n / 1e6:.0f}M parameters, {args.dtype}) "
          f"to {args.out_dir}")


if __name__ == "__main__":
    main()
