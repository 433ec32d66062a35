"""Tokenizer: a `tokenizers.Tokenizer` from `tokenizer.json`, plus streaming detokenisation."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """Encode text to ids (adding BOS the way the checkpoint says) and decode ids."""

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._tok = _HFTokenizer.from_file(file)
        self.bos_token_id, self.add_bos = None, False
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                tcfg = json.load(f)
            bos = tcfg.get("bos_token")
            bos = bos.get("content") if isinstance(bos, dict) else bos
            if bos is not None:
                self.bos_token_id = self._tok.token_to_id(bos)
            self.add_bos = bool(tcfg.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDecoder:
    """Text deltas for a growing list of ids.

    Decoding token by token splits multi-byte characters and drops BPE spaces, so we
    decode the whole tail and emit only what is new -- and hold back a trailing
    replacement char, which means a UTF-8 sequence is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._text = ""

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self._text = text[len(self._text):], text
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta, self._text = text[len(self._text):], text
        return delta
