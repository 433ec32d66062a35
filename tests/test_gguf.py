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

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from jaxpd.models import checkpoint, source
from jaxpd.models.llama import Llama
from tests.hf_fixtures import hf_greedy, hf_logits
from tests.support.gguf_files import (CHAT_TEMPLATE, CORPUS, SentencePieceVocab,
                                      gguf_tensors, random_k_blocks, train_bpe,
                                      write_gguf)
from tests.model_helpers import paged_greedy

Q = gguf.GGMLQuantizationType
TEXTS = ["Hello world!", "The lazy dog jumps over 42 quick foxes.", "  two  spaces\tand\nlines",
         "déjà vu 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "x <think> y"]
PROMPTS = ["Hello world, hello", "The quick brown fox", "Prefill and decode run on"]
NUM_NEW = 32


SPM_CONTROL = ["[INST]", "[/INST]"]
SPM_TEXTS = ["Hello world!", "The lazy dog jumps over 42 quick foxes.", " leading space",
             "trailing  ", "  two  spaces\tand\nlines\n\n", "\n", "12345 and 2024",
             "café naïve über 日本語 🙂", "[INST] hi [/INST]ok", "x </s>y", "", " "]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


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
    forward = jax.jit(lambda p, tokens: Llama(loaded.cfg).apply({"params": p}, tokens,
                                                                method=Llama.forward))
    for text in PROMPTS:
        prompt = loaded.tokenizer.encode(text)
        ours = forward(loaded.params, jnp.asarray([prompt]))[0]
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


@pytest.mark.slow
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
    with LLM(model=path, mesh="colocated=1", warmup=False) as llm:
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
