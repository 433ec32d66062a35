"""Tokenizer: a `tokenizers.Tokenizer` (from `tokenizer.json`, or built from a GGUF file's
metadata by `jaxpd.models.gguf`), plus streaming detokenisation."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """Encode text to ids (adding BOS the way the checkpoint says) and decode ids.

    `source`: a checkpoint directory (`tokenizer.json` [+ `tokenizer_config.json`]) or a
    built `tokenizers.Tokenizer`, whose BOS handling and chat template are then given
    explicitly. `chat_template` is the checkpoint's Jinja template, None if it has none.
    """

    def __init__(self, source: str | _HFTokenizer, bos_token_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None):
        if isinstance(source, _HFTokenizer):
            self._tok = source
        else:
            self._tok, bos_token_id, add_bos, chat_template = _read_dir(source)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it throughout: a
        # 4 MB text froze every other thread for seconds); one text, same ids.
        ids = self._tok.encode_batch([text], add_special_tokens=True)[0].ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_token(self, token_id: int | None) -> str | None:
        """The token's own text (special tokens included, e.g. "</s>"); None if unknown."""
        return None if token_id is None else self._tok.id_to_token(token_id)


def _read_dir(path: str) -> tuple[_HFTokenizer, int | None, bool, str | None]:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok = _HFTokenizer.from_file(file)
    bos_token_id, add_bos, chat_template = None, False, None
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            tcfg = json.load(f)
        bos = tcfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if bos is not None:
            bos_token_id = tok.token_to_id(bos)
        add_bos = bool(tcfg.get("add_bos_token", False))
        if isinstance(tcfg.get("chat_template"), str):
            chat_template = tcfg["chat_template"]
    # transformers >= 4.43 may write the template to its own file instead.
    jinja = os.path.join(path, "chat_template.jinja")
    if chat_template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            chat_template = f.read()
    return tok, bos_token_id, add_bos, chat_template


class IncrementalDecoder:
    """Text deltas for a growing list of ids, in time independent of the output's length.

    Decoding token by token splits multi-byte characters and drops the spaces that
    some tokenizers only render after a previous token, so each push decodes a short
    window (from a few tokens back) twice -- without and with the new ids -- and emits
    the difference; a trailing replacement character means a UTF-8 sequence is still
    incomplete, and its text waits for the next push (or `flush`).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0     # the window starts here
        self._read = 0       # ids before this are already emitted

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = max(self._read - 4, 0), len(self._ids)
        return text[len(before):]
