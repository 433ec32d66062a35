"""A GGUF file's tokenizer, rebuilt from its metadata (tokens, merges or SentencePiece
scores, token types, special ids) instead of a `tokenizer.json`: byte-level BPE
(`tokenizer.ggml.model` gpt2) or SentencePiece BPE with byte fallback (llama), as
transformers' GGUF loader builds it. Plain Python, no jax. `f` below is a
`gguf.GGUFFile` (its metadata through `get`/`require`; this module reads no tensor)."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from jaxpd.models.tokenizer import Tokenizer

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4   # tokenizer.ggml.token_type values

# How llama.cpp splits text before byte-level BPE, by `tokenizer.ggml.pre`. Unlisted
# types use GPT-2's split (ByteLevel's own regex), as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe",
                                            "dbrx", "falcon3")}
_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})
# Every digit on its own, then GPT-2's split (llama.cpp: `\p{N}` before the GPT-2 regex;
# the original tokenizer.json of SmolLM/StarCoder: `Digits(individual_digits=True)`).
_SPLIT_DIGITS = ("smollm", "starcoder", "refact", "codeshell")


def tokenizer(f) -> Tokenizer:
    """The tokenizer the metadata describes -- byte-level BPE (`tokenizer.ggml.model` gpt2)
    or SentencePiece BPE (llama) -- built as transformers builds it from the same file,
    with its special tokens, BOS/EOS handling and chat template."""
    kind = f.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{f.path}: tokenizer.ggml.model={kind!r} is not supported "
                         f"(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)")
    tokens = f.require("tokenizer.ggml.tokens")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = _byte_level_bpe(f, tokens) if kind == "gpt2" else _sentencepiece_bpe(f, tokens)

    ids = {name: f.get(f"tokenizer.ggml.{name}_token_id")
           for name in ("bos", "eos", "unknown", "padding")}
    special = [t for i, (t, ty) in enumerate(zip(tokens, types))
               if ty in (_UNKNOWN, _CONTROL) or i in ids.values()]
    if kind == "gpt2":
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding
        # it would grow the vocabulary past the model's (transformers skips it too).
        alphabet = set(_bytes_to_unicode().values())
        special = [t for t in special if set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and tok.token_to_id(t) is not None]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    if f.get("tokenizer.ggml.add_eos_token", False) and ids["eos"] is not None:
        eos = tokens[ids["eos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=["$A", eos], special_tokens=[(eos, ids["eos"])])
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = f.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return Tokenizer(tok, bos_token_id=ids["bos"], add_bos=bool(add_bos),
                     chat_template=f.get("tokenizer.chat_template"))


def _byte_level_bpe(f, tokens: list[str]) -> _HFTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte-level alphabet; respell any that are not (as
    # transformers does), so a special token written in plain UTF-8 still maps.
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
             for i, tok in enumerate(tokens)}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=_file_merges(f), fuse_unk=False,
                                  continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = _pre_tokenizer(f.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(f, tokens: list[str]) -> _HFTokenizer:
    """SentencePiece BPE as llama.cpp files it: "▁" for a space, `<0x00>`..`<0xFF>` for
    the bytes of text no piece covers, and a score per piece instead of merges."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _file_merges(f) or _merges_from_scores(
        tokens, f.require("tokenizer.ggml.scores"), vocab)
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                  unk_token=None if unk is None else tokens[unk],
                                  fuse_unk=True))
    # The whole text is one word (merges may cross spaces). The prefix space goes only
    # before the text's first piece, not after each special token: transformers'
    # `LlamaTokenizer` and the original tokenizer.json do this (llama.cpp puts one after
    # each special token too).
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _file_merges(f) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]


def _merges_from_scores(tokens: list[str], scores: list[float],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges from SentencePiece scores (a higher-scored piece merges first): each way
    to cut a piece into two pieces is a merge at its score; ties go to the longer left,
    then right, part, then to file order (transformers' `generate_merges`)."""
    scored = []
    for piece, score in zip(tokens, scores):
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                if piece[:k] in vocab and piece[k:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        scored += [(score, left, right) for left, right in cuts]
    # Stable under reverse=True: equal keys keep file order.
    scored.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in scored]


def _pre_tokenizer(pre: str | None):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _SPLIT_DIGITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table
