"""Writing GGUF files as llama.cpp's converter writes them, for tests: a byte-level BPE
vocabulary trained here, HF state dicts renamed and permuted, and `write_gguf`."""
import json
from typing import NamedTuple

import gguf
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello jaxpd!",
          "Prefill and decode run on separate meshes; pages move between them.",
          "Numbers like 12345 and 2024 split into digits.", "naïve café — déjà vu 日本語",
          "def f(x):\n    return x * 2\n"] * 20

class SentencePieceVocab(NamedTuple):
    """A vocabulary as llama.cpp files a SentencePiece one (`tokenizer.ggml.model` llama)."""
    tokens: list[str]
    scores: list[float]
    types: list[int]



def train_bpe():
    """(tokens, token types, merges) of a small byte-level BPE, as GGUF stores them."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS + USER_DEFINED,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in SPECIALS else 4 if t in USER_DEFINED else 1 for t in tokens]
    return tokens, types, merges


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [2, H/2] -> [H/2, 2] (rope pairs adjacent)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict, hf_cfg, arch: str) -> dict:
    """HF state dict -> GGUF tensor names and layout."""
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if "lm_head.weight" in state and not hf_cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    heads = {"attn_q": hf_cfg.num_attention_heads, "attn_k": hf_cfg.num_key_value_heads}
    for i in range(hf_cfg.num_hidden_layers):
        for hf_name, g in names.items():
            for kind in ("weight", "bias"):
                w = state.get(f"model.layers.{i}.{hf_name}.{kind}")
                if w is None:
                    continue
                if arch == "llama" and g in heads:
                    w = llama_cpp_permute(w, heads[g])
                out[f"blk.{i}.{g}.{kind}"] = w
    return out


def write_gguf(path: str, tensors: dict, qtype, *, arch, vocab, block_count, hidden, ffn, heads,
               kv_heads, head_dim=None, rope_theta=10000.0, eps=1e-6, pre="gpt-2", extra=None,
               raw: dict | None = None) -> str:
    """A GGUF file as llama.cpp writes it: 2-D weights in `qtype`, 1-D tensors F32.
    `vocab`: the `bpe` or `spm` fixture; `extra`: more metadata, bool or uint32;
    `raw`: name -> (uint8 blocks, qtype) written as they are."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny test model")
    w.add_block_count(block_count)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim or hidden // heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    if isinstance(vocab, SentencePieceVocab):
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab.tokens)
        w.add_token_scores(vocab.scores)
        w.add_token_types(vocab.types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        tokens, types, merges = vocab
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_uint32)(key, value)
    for name, t in tensors.items():
        t = np.asarray(t, np.float32)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    for name, (blocks, qt) in (raw or {}).items():
        w.add_tensor(name, blocks, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
