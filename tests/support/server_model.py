"""A tiny Llama checkpoint with a word-level tokenizer whose every id decodes to text:
what the single-process server tests serve."""
import os

from tests.engine_fixtures import build_hf_model

VOCAB = 256
SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "a small model serves every prompt it is given",
             "prefill and decode run on separate meshes"]


def build_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer.json filling the model's whole vocabulary: the words of
    SENTENCES, then filler words, so every id the model can emit decodes to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in sorted({w for s in SENTENCES for w in s.split()}):
        vocab[word] = len(vocab)
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))


def build_model(path: str) -> str:
    """The checkpoint, written at `path`."""
    build_hf_model("llama_gqa", path, vocab_size=VOCAB)
    build_tokenizer(path)
    return path

