"""`SamplingParams`: how one request is decoded, validated on construction."""
from __future__ import annotations

import dataclasses
import math
import secrets


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-like sampling options.

    temperature 0 means greedy. top_k 0 and top_p 1 mean off. `seed` makes sampling
    reproducible whatever batch the request lands in (the key of token i is derived
    from (seed, i) alone); without one a random seed is drawn per request.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) \
                or math.isinf(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) \
                or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    def resolved_seed(self) -> int:
        """The seed to use: the given one, or a fresh random one (31 bits: fits int32)."""
        return self.seed if self.seed is not None else secrets.randbelow(2**31)
