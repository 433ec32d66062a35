"""Corpus and tokenizer for the built-in default model, from text every Python carries.

The default model ships inside the package and is trained with no network, so its
text comes from the running interpreter itself:

- `pydoc_data.topics.topics`: the language reference sections `help()` shows;
- the docstrings of the `builtins` objects and their methods;
- module, class and function docstrings of the standard library, read from the
  source files with `ast` so that nothing is imported or executed.

Everything is walked in sorted order and deduplicated, so one interpreter version
always yields the same documents. About 5% of them, picked by a hash of their text
(stable when other documents come or go), are held out for validation.

`python -m launch.default_corpus --out DIR` writes the tokenizer (a 4096-entry
byte-level BPE with `<pad>`, `<s>`, `</s>`) and prints the corpus statistics.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import inspect
import json
import os
import re
import sys
import sysconfig
import warnings
import zlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)          # ids 0, 1, 2
VOCAB_SIZE = 4096
VAL_PERCENT = 5
MIN_DOC_CHARS = 24                         # shorter docstrings ("Return self.") teach nothing

# Directories of the stdlib tree that are not library documentation: tests, the IDLE
# and turtle demos, vendored wheels, build configuration, third-party packages.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "turtledemo", "site-packages",
                       "dist-packages", "__pycache__", "__phello__", "_bundled", "lib-dynload"})
WORD_RE = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Deduplicated documents, split deterministically into train and validation."""
    train: list[str]
    val: list[str]

    @property
    def num_chars(self) -> int:
        return sum(map(len, self.train)) + sum(map(len, self.val))


def normalise(text: str) -> str:
    """Strip trailing spaces, turn tabs into spaces and squeeze runs of blank lines."""
    lines = [line.rstrip().replace("\t", "    ") for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted .py files of the standard library, minus tests, demos and vendored code."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # config-3.x-<platform> holds the build's Makefile helpers, not library modules.
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata")):
                files.append(os.path.join(dirpath, name))
    return files


def source_docstrings(path: str) -> list[str]:
    """Module, class and function docstrings of one source file, in source order."""
    try:
        with open(path, "rb") as f:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)   # e.g. invalid escapes
                tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []   # lib2to3 grammar samples and the like are not Python 3 source
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    # ast.walk is breadth-first but deterministic; sorting by line keeps source order.
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, kinds)),
                   key=lambda n: getattr(n, "lineno", 0))
    return [doc for doc in (ast.get_docstring(n, clean=True) for n in nodes) if doc]


def builtin_docstrings() -> list[str]:
    """Docstrings of the `builtins` names and their public methods (already loaded, so
    reading them runs no code)."""
    docs = []
    for name in sorted(dir(builtins)):
        if name.startswith("_"):
            continue
        obj = getattr(builtins, name)
        docs.append(inspect.getdoc(obj) or "")
        if isinstance(obj, type):
            for attr in sorted(vars(obj)):
                if not attr.startswith("_"):
                    docs.append(inspect.getdoc(vars(obj)[attr]) or "")
    return docs


def pydoc_topics() -> list[str]:
    """The language reference topics of `help()`, by topic name."""
    from pydoc_data.topics import topics
    return [topics[key] for key in sorted(topics)]


def is_val(doc: str) -> bool:
    """Held out for validation: a fixed ~5% of documents, chosen by content hash."""
    return zlib.crc32(doc.encode("utf-8")) % 100 < VAL_PERCENT


def build_corpus() -> Corpus:
    """Collect, normalise, dedupe and split the documents of this interpreter."""
    raw = pydoc_topics() + builtin_docstrings()
    for path in stdlib_files():
        raw.extend(source_docstrings(path))
    seen, train, val = set(), [], []
    for doc in map(normalise, raw):
        if len(doc) < MIN_DOC_CHARS or doc in seen:
            continue
        seen.add(doc)
        (val if is_val(doc) else train).append(doc)
    return Corpus(train, val)


def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE whose encode prepends `<s>` and whose decode returns the text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def save_tokenizer(tok: Tokenizer, out: str, max_length: int) -> None:
    """`tokenizer.json` plus the `tokenizer_config.json` transformers and jaxpd read."""
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        # The post-processor already adds BOS; asking for it again would double it.
        "add_bos_token": False, "add_eos_token": False,
        # Cleanup would eat spaces before punctuation, so decode would not round-trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def encode_stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    """All documents as one id stream, each `<s> text </s>` (BOS from the post-processor)."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=True):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return ids


def corpus_words(docs: list[str], min_count: int = 2) -> list[str]:
    """Lower-cased words seen at least `min_count` times: the vocabulary generated text
    is checked against (rare words are left out to keep the shipped list small)."""
    counts: dict[str, int] = {}
    for doc in docs:
        for word in WORD_RE.findall(doc):
            word = word.lower()
            counts[word] = counts.get(word, 0) + 1
    return sorted(w for w, c in counts.items() if c >= min_count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for the tokenizer files")
    args = parser.parse_args()
    corpus = build_corpus()
    tok = train_tokenizer(corpus.train)
    save_tokenizer(tok, args.out, max_length=1024)
    stats = {"python": sys.version.split()[0], "docs_train": len(corpus.train),
             "docs_val": len(corpus.val), "chars": corpus.num_chars,
             "tokens_train": len(encode_stream(tok, corpus.train)),
             "tokens_val": len(encode_stream(tok, corpus.val))}
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
