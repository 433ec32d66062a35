"""What a request must satisfy before any engine sees it -- one set of checks for
every door: the public front ends (`LLM`, `Router`, the gRPC service) and the
internal RPCs a role process receives from its peers (whose input is untrusted too).

Plain Python; every failure is a `ValueError` whose message names the field.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from jaxpd.sampling_params import SamplingParams

MAX_REQUEST_ID_LEN = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]+")
# Prompt text is refused before it is tokenized when it is longer than this many bytes
# per token of max_prompt_len (real tokenizers average 3-5 bytes a token; 32 leaves room
# for long whitespace and repeat tokens), and never below the floor. Tokenizing costs
# about a microsecond a byte: the limit is what keeps that work bounded.
BYTES_PER_TOKEN = 32
MIN_PROMPT_BYTES = 64 * 1024
MAX_STOP_TOKEN_IDS = 256


def check_request_id(request_id: Any) -> str:
    """A client- or peer-chosen id: 1..128 printable ASCII characters from
    `[A-Za-z0-9._:@/+=-]` (no NUL, no whitespace, no terminal escapes)."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
    if not request_id:
        raise ValueError("request_id is empty")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id has {len(request_id)} characters, more than "
                         f"{MAX_REQUEST_ID_LEN}")
    if not _REQUEST_ID.fullmatch(request_id):
        raise ValueError("request_id may only contain letters, digits and . _ : @ / + = -")
    return request_id


def default_max_prompt_bytes(max_prompt_len: int) -> int:
    """The longest prompt text (UTF-8 bytes) worth tokenizing for `max_prompt_len` tokens."""
    return max(max_prompt_len * BYTES_PER_TOKEN, MIN_PROMPT_BYTES)


def check_text_size(text: str, max_bytes: int, field: str = "prompt") -> str:
    """Text that may be tokenized: at most `max_bytes` UTF-8 bytes. Checked before the
    tokenizer sees it, so an oversized text costs a length check, not a tokenization."""
    # Characters never outnumber bytes: a text over the limit in characters is refused
    # without encoding it.
    if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ValueError(f"{field} is longer than max_prompt_bytes={max_bytes} bytes of "
                         f"UTF-8 text (refused before tokenizing)")
    return text


def check_token_ids(ids: Any, vocab_size: int, field: str) -> list[int]:
    """A list of ints in [0, vocab_size)."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def check_request(prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                  max_prompt_len: int, max_model_len: int, output_ids: Sequence[int] = ()
                  ) -> list[int]:
    """The prompt (and any output already generated elsewhere) against the vocabulary and
    this side's length limits; returns the prompt as a list."""
    ids = check_token_ids(prompt_ids, vocab_size, "prompt_token_ids")
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    check_token_ids(output_ids, vocab_size, "output_ids")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids, more than "
                         f"{MAX_STOP_TOKEN_IDS}")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids: {bad_stop[0]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(ids) > max_prompt_len:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_prompt_len="
                         f"{max_prompt_len}")
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens={params.max_tokens} with a {len(ids)}-token prompt "
                         f"exceeds max_model_len={max_model_len}")
    if len(output_ids) >= params.max_tokens:
        raise ValueError(f"output_ids: {len(output_ids)} tokens already, max_tokens="
                         f"{params.max_tokens}: nothing left to generate")
    return ids
