"""What `LLM.generate` / `LLM.stream` hand back."""
from __future__ import annotations

import dataclasses

from jaxpd.metrics import tpot, ttft
from jaxpd.request import Request, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds (None where the phase did not happen)."""
    queue_s: float | None
    prefill_s: float | None
    transfer_s: float
    transfer_bytes: int
    ttft_s: float | None
    tpot_s: float | None          # mean gap between output tokens, first token excluded
    itl_s: list[float]
    e2e_s: float | None
    num_preemptions: int

    @classmethod
    def of(cls, r: Request) -> "RequestMetrics":
        t = r.timings
        times = t.token_times
        itl = [b - a for a, b in zip(times, times[1:])]
        return cls(
            queue_s=None if t.prefill_start is None else t.prefill_start - t.arrival,
            prefill_s=None if t.prefill_end is None else t.prefill_end - t.prefill_start,
            transfer_s=t.transfer_s, transfer_bytes=t.transfer_bytes,
            ttft_s=ttft(t.arrival, times), tpot_s=tpot(times),
            itl_s=itl,
            e2e_s=None if t.finish is None else t.finish - t.arrival,
            num_preemptions=t.num_preemptions)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of one prompt. `text` is cut before the first stop string (None
    without a tokenizer); `logprobs` has one `TokenLogprobs` per token id when the
    request asked for them; `index` numbers the samples of a prompt (`n` > 1)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str            # "stop" | "length" | "abort"
    abort_reason: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request since the last delta: their text (what is certain
    to be output: text that may begin a stop string waits) and log-probabilities."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
