"""`SamplingParams`: how one request is decoded, validated on construction."""
from __future__ import annotations

import dataclasses
import math
import secrets

MAX_LOGPROBS = 20        # top log-probabilities returned per token
MAX_N = 16               # samples per prompt
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def _number(value, field: str, low: float, high: float, *, open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not (low < value if open_low else low <= value) or not value <= high:
        bound = "(" if open_low else "["
        raise ValueError(f"{field} must be a number in {bound}{low}, {high}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-like sampling options.

    temperature 0 means greedy. top_k 0, top_p 1 and min_p 0 mean off. `seed` makes
    sampling reproducible whatever batch the request lands in (the key of token i is
    derived from (seed, i) alone); without one a random seed is drawn per request.

    Penalties (all applied to the logits on device before temperature, as vLLM does):
    `repetition_penalty` r divides a positive logit by r and multiplies a negative one
    by r for every token seen in the prompt or the output so far (1 = off);
    `presence_penalty` is subtracted once from every token the output contains,
    `frequency_penalty` once per occurrence (OpenAI's definitions; 0 = off).
    `min_p` drops tokens whose probability is below min_p times the top token's.

    `stop`: strings that end the request (finish reason "stop"); the text returned is
    cut before the first of them, which may span several tokens. `logprobs`: return
    the log-probability of each sampled token and the `logprobs` most likely ones
    (0..20; None = none), from the model's distribution before any penalty or
    temperature. `n`: samples per prompt (each its own request; seeded ones use seed,
    seed+1, ...).
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or math.isnan(self.temperature) or math.isinf(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        _number(self.top_p, "top_p", 0, 1, open_low=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        stop_ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings, more than {MAX_STOP_STRINGS}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters")
        object.__setattr__(self, "stop", tuple(stop))
        _number(self.repetition_penalty, "repetition_penalty", 0, 10, open_low=True)
        _number(self.presence_penalty, "presence_penalty", -2, 2)
        _number(self.frequency_penalty, "frequency_penalty", -2, 2)
        _number(self.min_p, "min_p", 0, 1)
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.logprobs!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def resolved_seed(self) -> int:
        """The seed to use: the given one, or a fresh random one (31 bits: fits int32)."""
        return self.seed if self.seed is not None else secrets.randbelow(2**31)

    def to_wire(self) -> dict:
        """Msgpack-able form (`SamplingParams(**d)` rebuilds it)."""
        d = dataclasses.asdict(self)
        d["stop_token_ids"], d["stop"] = list(self.stop_token_ids), list(self.stop)
        return d
