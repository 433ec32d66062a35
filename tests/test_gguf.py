"""GGUF files load to the same model and tokenizer as Hugging Face transformers reads
from the same file (`from_pretrained(dir, gguf_file=...)`), for every quant type.

The files are written here with `gguf.GGUFWriter`, the way llama.cpp's converter writes
them (q/k rows permuted for llama, 1-D tensors kept F32): weights of a tiny random
transformers model quantized with `gguf.quants.quantize` (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0), or random K-quant blocks (Q4_K, Q5_K, Q6_K: `gguf` only dequantizes those,
so they are tested on the read side), and a byte-level BPE or a SentencePiece vocabulary
(scores, no merges, byte fallback) trained here.
"""
import json
import os
from typing import NamedTuple

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxpd.models import checkpoint, source
from jaxpd.models.llama import Llama
from tests.hf_fixtures import hf_greedy, hf_logits
from tests.model_helpers import paged_greedy

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello jaxpd!",
          "Prefill and decode run on separate meshes; pages move between them.",
          "Numbers like 12345 and 2024 split into digits.", "naïve café — déjà vu 日本語",
          "def f(x):\n    return x * 2\n"] * 20
TEXTS = ["Hello world!", "The lazy dog jumps over 42 quick foxes.", "  two  spaces\tand\nlines",
         "déjà vu 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "x <think> y"]
PROMPTS = ["Hello world, hello", "The quick brown fox", "Prefill and decode run on"]
NUM_NEW = 32


class SentencePieceVocab(NamedTuple):
    """A vocabulary as llama.cpp files a SentencePiece one (`tokenizer.ggml.model` llama)."""
    tokens: list[str]
    scores: list[float]
    types: list[int]


SPM_CONTROL = ["[INST]", "[/INST]"]
SPM_TEXTS = ["Hello world!", "The lazy dog jumps over 42 quick foxes.", " leading space",
             "trailing  ", "  two  spaces\tand\nlines\n\n", "\n", "12345 and 2024",
             "café naïve über 日本語 🙂", "[INST] hi [/INST]ok", "x </s>y", "", " "]


@pytest.fixture(scope="module")
def bpe():
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


@pytest.fixture(scope="module")
def spm():
    """A SentencePiece BPE laid out as in Llama 2's file: <unk> <s> </s> (and two control
    tokens), the 256 byte tokens, then pieces scored best merge first, then single
    characters; text outside the corpus' alphabet (日本語, 🙂, ü) falls back to bytes."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator([text for text in CORPUS if "日" not in text] + ["naïve café — déjà vu"],
                            trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    pieces = ["".join(m if isinstance(m, list) else m.split(" ")) for m in model["merges"]]
    chars = sorted(t for t in model["vocab"] if len(t) == 1)
    head = ["<unk>", "<s>", "</s>"] + SPM_CONTROL + [f"<0x{b:02X}>" for b in range(256)]
    return SentencePieceVocab(
        tokens=head + pieces + chars,
        scores=[0.0] * len(head) + [-float(i) for i in range(len(pieces) + len(chars))],
        types=[2, 3, 3] + [3] * len(SPM_CONTROL) + [6] * 256 + [1] * (len(pieces) + len(chars)))


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


def write_from_hf(tmp_path, hf_model, qtype, vocab, arch="llama") -> str:
    cfg = hf_model.config
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    head_dim = getattr(cfg, "head_dim", None)
    path = os.path.join(tmp_path, f"{arch}-{qtype.name}.gguf")
    return write_gguf(path, gguf_tensors(state, cfg, arch), qtype, arch=arch, vocab=vocab,
                      block_count=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                      ffn=cfg.intermediate_size, heads=cfg.num_attention_heads,
                      kv_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_parameters["rope_theta"],
                      eps=cfg.rms_norm_eps,
                      head_dim=head_dim if head_dim != cfg.hidden_size // cfg.num_attention_heads else None)


def transformers_gguf(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def assert_same_model(path: str, reference, atol=1e-4, greedy_prompts=PROMPTS):
    """Our GGUF load == `reference` (a torch model): logits close on every prompt, greedy
    tokens (prefill + paged decode) equal on `greedy_prompts`."""
    loaded = checkpoint.load(path)
    for text in PROMPTS:
        prompt = loaded.tokenizer.encode(text)
        ours = Llama(loaded.cfg).apply({"params": loaded.params}, jnp.asarray([prompt]),
                                       method=Llama.forward)[0]
        np.testing.assert_allclose(np.asarray(ours), hf_logits(reference, prompt), atol=atol, rtol=1e-4)
        if text in greedy_prompts:
            tokens, _ = paged_greedy(loaded.cfg, loaded.params, prompt, NUM_NEW)
            assert tokens == hf_greedy(reference, prompt, NUM_NEW)
    return loaded


# ---- model parity -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_llama(hf_models, bpe):
    return hf_models("llama_gqa", vocab_size=len(bpe[0]))[1]


@pytest.mark.slow
def test_q8_0_matches_transformers_and_f32_matches_the_source_model(tmp_path, hf_llama, bpe):
    # F32: the permutation round trip gives back the very model the file came from.
    assert_same_model(write_from_hf(tmp_path, hf_llama, Q.F32, bpe), hf_llama, greedy_prompts=())
    path = write_from_hf(tmp_path, hf_llama, Q.Q8_0, bpe)
    assert_same_model(path, transformers_gguf(path), greedy_prompts=PROMPTS[:1])


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q4_1], ids=lambda q: q.name)
def test_quant_types_match_transformers(tmp_path, hf_llama, bpe, qtype):
    path = write_from_hf(tmp_path, hf_llama, qtype, bpe)
    assert_same_model(path, transformers_gguf(path))


@pytest.mark.slow
@pytest.mark.parametrize("name,arch,qtype", [("llama_tied", "llama", Q.F16),
                                              ("qwen2_bias", "qwen2", Q.Q8_0)],
                         ids=["llama_tied-F16", "qwen2_bias-Q8_0"])
def test_tied_embeddings_and_qwen2_bias_match_transformers(tmp_path, hf_models, bpe, name, arch, qtype):
    hf_model = hf_models(name, vocab_size=len(bpe[0]))[1]
    path = write_from_hf(tmp_path, hf_model, qtype, bpe, arch=arch)
    loaded = assert_same_model(path, transformers_gguf(path))
    assert loaded.cfg.tie_word_embeddings == (name == "llama_tied")
    assert loaded.cfg.attention_bias == (arch == "qwen2")


def test_qwen3_gguf_matches_the_source_model_and_transformers(tmp_path, hf_models, bpe):
    """Qwen3's q/k norms come from `attn_q_norm`/`attn_k_norm`, its q/k rows unpermuted."""
    hf_model = hf_models("qwen3", vocab_size=len(bpe[0]))[1]
    path = write_from_hf(tmp_path, hf_model, Q.F32, bpe, arch="qwen3")
    loaded = assert_same_model(path, hf_model, greedy_prompts=PROMPTS[:1])
    assert loaded.cfg.qk_norm and loaded.cfg.model_type == "qwen3"


@pytest.mark.slow
def test_llama_with_a_sentencepiece_vocabulary_matches_transformers(tmp_path, hf_models, spm):
    hf_model = hf_models("llama_gqa", vocab_size=len(spm.tokens))[1]
    path = write_from_hf(tmp_path, hf_model, Q.Q8_0, spm)
    # Prompts start with BOS, as llama.cpp tokenizes them for this vocabulary.
    loaded = assert_same_model(path, transformers_gguf(path), greedy_prompts=())
    assert loaded.tokenizer.encode(PROMPTS[0])[0] == spm.tokens.index("<s>")


def random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks with small f16 scales (random bytes there could be inf)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    # Byte offsets of the f16 super-block scales: d and dmin first, or d last (Q6_K).
    offsets = (size - 2,) if qtype == Q.Q6_K else (0, 2)
    scale = 3e-5 if qtype == Q.Q6_K else 2e-4
    for off in offsets:
        blocks[:, off:off + 2] = rng.uniform(scale / 2, scale, len(blocks)).astype(np.float16) \
            .view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


@pytest.mark.slow
def test_k_quants_read_like_transformers(tmp_path, bpe):
    """Q4_K, Q5_K and Q6_K weights (dimensions multiples of 256), F32 norms."""
    rng = np.random.default_rng(0)
    d, f, n, k, layers, v = 256, 512, 4, 2, 2, len(bpe[0])
    kinds = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
    shapes = {"token_embd.weight": (v, d), "output.weight": (v, d)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (d * k // n, d),
                       f"blk.{i}.attn_v.weight": (d * k // n, d), f"blk.{i}.attn_output.weight": (d, d),
                       f"blk.{i}.ffn_gate.weight": (f, d), f"blk.{i}.ffn_up.weight": (f, d),
                       f"blk.{i}.ffn_down.weight": (d, f)})
    raw = {name: (random_k_blocks(*shape, kinds[j % 3], rng), kinds[j % 3])
           for j, (name, shape) in enumerate(shapes.items())}
    norms = {"output_norm.weight": np.full(d, 4.0)}
    for i in range(layers):
        norms.update({f"blk.{i}.attn_norm.weight": rng.uniform(0.5, 1.5, d),
                      f"blk.{i}.ffn_norm.weight": rng.uniform(0.5, 1.5, d)})
    path = write_gguf(str(tmp_path / "k.gguf"), norms, Q.F32, arch="llama", vocab=bpe,
                      block_count=layers, hidden=d, ffn=f, heads=n, kv_heads=k, raw=raw)
    assert_same_model(path, transformers_gguf(path), atol=2e-4)


@pytest.mark.slow
def test_llm_serves_a_gguf_file(tmp_path, hf_llama, bpe):
    from jaxpd import LLM, SamplingParams
    path = write_from_hf(tmp_path, hf_llama, Q.Q8_0, bpe)
    reference = transformers_gguf(path)
    with LLM(model=path, mesh="colocated=1") as llm:
        assert llm.tokenizer.chat_template == CHAT_TEMPLATE
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW, temperature=0.0,
                                                    ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        prompt = llm.tokenizer.encode(text)
        assert list(out.token_ids) == hf_greedy(reference, prompt, NUM_NEW)


# ---- tokenizer and config -----------------------------------------------------------

def tiny_file(tmp_path, vocab, name="t.gguf", arch="llama", qtype=Q.F32, tensors=None, **kw):
    """A 1-layer model with zero weights: enough for metadata and error tests."""
    tensors = _zero_tensors(len(vocab[0])) if tensors is None else tensors
    d = 32
    return write_gguf(str(tmp_path / name), tensors, qtype, arch=arch, vocab=vocab, block_count=1,
                      hidden=d, ffn=64, heads=4, kv_heads=2, **kw)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_tokenizer_matches_transformers(tmp_path, bpe, pre):
    from transformers import AutoTokenizer
    path = tiny_file(tmp_path, bpe, pre=pre)
    _, ours = source.model_config_and_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("<|im_start|>") == [bpe[0].index("<|im_start|>")]
    assert ours.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("extra", [{}, {"tokenizer.ggml.add_bos_token": False,
                                          "tokenizer.ggml.add_eos_token": True}],
                         ids=["defaults", "eos-not-bos"])
def test_sentencepiece_tokenizer_matches_transformers(tmp_path, spm, extra):
    from transformers import AutoTokenizer
    path = tiny_file(tmp_path, spm, extra=extra)
    _, ours = source.model_config_and_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # Merges make whole words; bytes stand in for what no piece spells.
    pieces = {text: [spm.tokens[i] for i in ours.encode(text) if i not in (1, 2)]
              for text in ("quick brown", "日")}
    assert pieces == {"quick brown": ["▁quick", "▁brown"], "日": ["▁", "<0xE6>", "<0x97>", "<0xA5>"]}
    assert ours.add_bos == (not extra) and ours.chat_template == CHAT_TEMPLATE


def test_sentencepiece_without_space_prefix(tmp_path, spm):
    """`tokenizer.ggml.add_space_prefix` false: no "▁" before the text, none stripped from
    the decoded text (transformers ignores this key; llama.cpp honours it)."""
    no_bos = {"tokenizer.ggml.add_bos_token": False}
    _, plain = source.model_config_and_tokenizer(tiny_file(tmp_path, spm, extra=no_bos))
    _, bare = source.model_config_and_tokenizer(tiny_file(
        tmp_path, spm, name="bare.gguf", extra=dict(no_bos, **{"tokenizer.ggml.add_space_prefix": False})))
    assert bare.encode(" Hello world") == plain.encode("Hello world")
    assert bare.encode("Hello")[0] != plain.encode("Hello")[0]
    for text in SPM_TEXTS:
        if not any(special in text for special in ["</s>"] + SPM_CONTROL):
            assert bare.decode(bare.encode(text)) == text


def test_llama_gguf_with_a_sentencepiece_vocabulary_loads(tmp_path, spm):
    loaded = checkpoint.load(tiny_file(tmp_path, spm))
    assert loaded.cfg.vocab_size == len(spm.tokens) == loaded.params["embed_tokens"].shape[0]
    assert (loaded.cfg.bos_token_id, loaded.cfg.eos_token_ids) == (1, (2,))
    ids = loaded.tokenizer.encode("Hello world, 日本語")
    assert ids[0] == 1 and max(ids) < len(spm.tokens)
    assert loaded.tokenizer.decode(ids) == "Hello world, 日本語"
    assert loaded.tokenizer.id_to_token(2) == "</s>"


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path, bpe):
    _, tok = source.model_config_and_tokenizer(tiny_file(tmp_path, bpe, pre="smollm"))
    ids = tok.encode("year 2024")
    assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]


def test_config_from_metadata(tmp_path, bpe):
    path = tiny_file(tmp_path, bpe, rope_theta=50000.0, eps=1e-5)
    cfg, tok = source.model_config_and_tokenizer(path)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 1, 32, 64)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 8)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (len(bpe[0]), 512)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == bpe[0].index("<|endoftext|>")
    assert cfg.eos_token_ids == (bpe[0].index("<|im_end|>"),)
    assert not tok.add_bos


def test_unsupported_architecture_names_the_field(tmp_path, bpe):
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        source.model_config_and_tokenizer(tiny_file(tmp_path, bpe, arch="gpt2"))


def test_unsupported_tokenizer_model_names_the_field(tmp_path, bpe):
    path = tiny_file(tmp_path, bpe)
    f = gguf.GGUFReader(path, "r+")
    # Same length as "gpt2", so the file can be edited in place.
    field = f.fields["tokenizer.ggml.model"]
    field.parts[field.data[0]][:] = np.frombuffer(b"t5xx", np.uint8)
    del f
    with pytest.raises(ValueError, match="tokenizer.ggml.model='t5xx'"):
        source.model_config_and_tokenizer(path)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path, bpe):
    raw = {"blk.0.attn_v.weight": (np.zeros((16, 40), np.uint8), Q.Q8_1)}  # 32 cols, 40 B/block
    path = tiny_file(tmp_path, bpe, raw=raw, tensors={
        n: t for n, t in _zero_tensors(len(bpe[0])).items() if n != "blk.0.attn_v.weight"})
    with pytest.raises(ValueError, match="'blk.0.attn_v.weight' has quant type Q8_1"):
        checkpoint.load(path)


def test_rope_frequency_factors_are_refused(tmp_path, bpe):
    tensors = dict(_zero_tensors(len(bpe[0])), **{"rope_freqs.weight": np.ones(4)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        source.model_config_and_tokenizer(tiny_file(tmp_path, bpe, tensors=tensors))


def test_unknown_tensor_is_refused(tmp_path, bpe):
    tensors = dict(_zero_tensors(len(bpe[0])), **{"blk.0.attn_q_norm.weight": np.ones(8)})
    with pytest.raises(ValueError, match="attn_q_norm"):
        checkpoint.load(tiny_file(tmp_path, bpe, tensors=tensors))


def _zero_tensors(v, d=32):
    tensors = {"token_embd.weight": np.zeros((v, d)), "output_norm.weight": np.ones(d)}
    for g, shape in {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (d, d), "attn_k": (d // 2, d),
                     "attn_v": (d // 2, d), "attn_output": (d, d), "ffn_gate": (64, d),
                     "ffn_up": (64, d), "ffn_down": (d, 64)}.items():
        tensors[f"blk.0.{g}.weight"] = np.zeros(shape)
    return tensors


def test_directory_with_one_gguf_file_is_that_file(tmp_path, bpe):
    """A GGUF repository downloaded from a hub: no config.json, one .gguf file."""
    path = tiny_file(tmp_path, bpe)
    assert source.checkpoint_path(str(tmp_path)) == path
    cfg, _ = source.model_config_and_tokenizer(str(tmp_path))
    assert cfg.num_layers == 1
    tiny_file(tmp_path, bpe, name="other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        source.checkpoint_path(str(tmp_path))
