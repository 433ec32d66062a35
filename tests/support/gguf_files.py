"""Writing GGUF files as llama.cpp's converter writes them, for tests: a byte-level BPE
vocabulary trained here, HF state dicts renamed and permuted, a saved checkpoint's
tensors and metadata as the converter turns them out (`converter_tensors`,
`converter_metadata`), and `write_gguf`."""
import json
import os
import re
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
    """A GGUF file as llama.cpp writes it: 2-D and 3-D weights in `qtype` (F16 where a
    row does not split into its blocks), 1-D tensors and routers (`ffn_gate_inp`) F32.
    `vocab`: the `bpe` or `spm` fixture; `extra`: more metadata, bool, uint32, float32,
    string or array by the value's type; `raw`: name -> (uint8 blocks, qtype) written as
    they are."""
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
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string,
               list: w.add_array}
        add[type(value)](key, value)
    for name, t in tensors.items():
        t = np.asarray(t, np.float32)
        if t.ndim == 1 or qtype == Q.F32 or name.endswith(".ffn_gate_inp.weight"):
            w.add_tensor(name, t)
        elif qtype == Q.F16 or t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
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


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def converter_tensors(hf_dir: str, hf_cfg, arch: str) -> dict:
    """The tensors llama.cpp's converter writes for the checkpoint saved in `hf_dir`
    (`model.safetensors`, one tensor per expert as transformers saves it): names
    through gguf's own `TensorNameMap`; q/k rows permuted for llama; each layer's
    experts stacked [E, out, in] (Mixtral's w1/w2/w3 as its `LlamaModel` names them);
    Gemma's norms + 1; gemma2's lm_head dropped; every tensor squeezed."""
    from safetensors.numpy import load_file

    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    arch_id = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, hf_cfg.num_hidden_layers)
    heads = {"q_proj": hf_cfg.num_attention_heads, "k_proj": hf_cfg.num_key_value_heads}
    experts: dict = {}
    out = {}
    for hf_name, w in state.items():
        if m := _EXPERT.match(hf_name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = w
            continue
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        proj = hf_name.split(".")[-2]
        if arch == "llama" and proj in heads and hf_name.endswith(".weight"):
            w = llama_cpp_permute(w, heads[proj])
        out[_gguf_name(names, hf_name)] = w.squeeze()
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        merged = (f"layers.{layer}.feed_forward.experts.{proj}.weight" if arch == "llama"
                  else f"model.layers.{layer}.mlp.experts.{proj}.weight")
        out[_gguf_name(names, merged)] = stacked
    return out


def _gguf_name(names, hf_name: str) -> str:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise KeyError(f"llama.cpp's converter maps no tensor for {hf_name!r}")
    return name


def converter_metadata(hf_cfg, arch: str) -> dict:
    """The architecture metadata beyond `write_gguf`'s own keys that the converter
    writes for `hf_cfg` (Gemma's window, softcaps and rope; the experts' counts and
    sizes), as `write_gguf(extra=...)`."""
    extra = {}
    get = lambda name: getattr(hf_cfg, name, None)   # noqa: E731
    if arch == "gemma2":
        extra[f"{arch}.attention.sliding_window"] = int(get("sliding_window"))
        extra[f"{arch}.attn_logit_softcapping"] = float(get("attn_logit_softcapping"))
        extra[f"{arch}.final_logit_softcapping"] = float(get("final_logit_softcapping"))
    if arch == "gemma3":
        rope = get("rope_parameters") or {}
        full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
        if full.get("rope_type") == "linear":
            extra[f"{arch}.rope.scaling.type"] = "linear"
            extra[f"{arch}.rope.scaling.factor"] = float(full["factor"])
        if "rope_theta" in local:
            extra[f"{arch}.rope.freq_base_swa"] = float(local["rope_theta"])
        if get("sliding_window_pattern") != 1:
            extra[f"{arch}.attention.sliding_window"] = int(get("sliding_window"))
        if get("final_logit_softcapping"):
            extra[f"{arch}.final_logit_softcapping"] = float(get("final_logit_softcapping"))
    experts = get("num_local_experts") or get("num_experts")
    if experts:
        extra[f"{arch}.expert_count"] = int(experts)
        extra[f"{arch}.expert_used_count"] = int(get("num_experts_per_tok"))
    if arch in ("qwen2moe", "qwen3moe"):
        extra[f"{arch}.expert_feed_forward_length"] = int(get("moe_intermediate_size"))
    if arch == "qwen2moe" and get("shared_expert_intermediate_size"):
        extra[f"{arch}.expert_shared_feed_forward_length"] = int(
            get("shared_expert_intermediate_size"))
    return extra


def random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks with small f16 scales (random bytes there could be inf)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    # Byte offsets of the f16 super-block scales: d and dmin first, or d last (Q6_K).
    offsets = (size - 2,) if qtype == gguf.GGMLQuantizationType.Q6_K else (0, 2)
    scale = 3e-5 if qtype == gguf.GGMLQuantizationType.Q6_K else 2e-4
    for off in offsets:
        blocks[:, off:off + 2] = rng.uniform(scale / 2, scale, len(blocks)).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)
