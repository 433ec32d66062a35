"""Synthetic benchmark workloads: Poisson arrivals, prompt/output lengths from mixes.

A length mix is written as on the command line, `"64:3,512:4,2048:1"`: length 64
with weight 3, 512 with weight 4, 2048 with weight 1 (weights need not sum to
anything). A bare `"128"` is length 128 with weight 1.

`make_workload` is a pure function of its arguments. Arrivals and the two length
draws use independent random streams spawned from `seed`, and arrivals are unit
exponential gaps divided by `rate`; so the same seed at two rates gives the same
requests (same lengths, same order), the faster run being the slower one with its
time axis compressed. That keeps a goodput search over rates comparing like with like.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Union

import numpy as np

LengthMix = Sequence[tuple[int, float]]


def parse_length_mix(text: str) -> list[tuple[int, float]]:
    """Parse `"len[:weight],..."` into [(length, weight), ...].

    Lengths must be positive integers, weights positive finite numbers. Raises
    ValueError naming the whole flag text and the offending part.
    """
    def fail(part: str, why: str) -> ValueError:
        return ValueError(f"length mix {text!r}: bad part {part!r}: {why}")

    if not text.strip():
        raise ValueError(f"length mix {text!r} is empty; expected e.g. '64:3,512:1'")
    mix = []
    for part in text.split(","):
        pieces = part.strip().split(":")
        if not part.strip():
            raise fail(part, "empty entry")
        if len(pieces) > 2:
            raise fail(part, "expected 'length' or 'length:weight'")
        length_text = pieces[0].strip()
        weight_text = pieces[1].strip() if len(pieces) == 2 else "1"
        try:
            length = int(length_text)
        except ValueError:
            raise fail(part, f"length {length_text!r} is not an integer") from None
        if length <= 0:
            raise fail(part, f"length must be positive, got {length}")
        try:
            weight = float(weight_text)
        except ValueError:
            raise fail(part, f"weight {weight_text!r} is not a number") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise fail(part, f"weight must be positive and finite, got {weight_text}")
        mix.append((length, weight))
    return mix


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One synthetic request: when it arrives and how long its prompt and output are."""
    arrival_s: float
    prompt_len: int
    output_len: int
    index: int

    def __post_init__(self):
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"WorkloadRequest.arrival_s must be >= 0 and finite, "
                             f"got {self.arrival_s}")
        if self.prompt_len < 1:
            raise ValueError(f"WorkloadRequest.prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise ValueError(f"WorkloadRequest.output_len must be >= 1, got {self.output_len}")
        if self.index < 0:
            raise ValueError(f"WorkloadRequest.index must be >= 0, got {self.index}")


def _as_mix(name: str, mix: Union[str, LengthMix]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, probabilities) of a mix given as flag text or as (length, weight) pairs."""
    pairs = parse_length_mix(mix) if isinstance(mix, str) else list(mix)
    if not pairs:
        raise ValueError(f"make_workload {name} is empty")
    for length, weight in pairs:
        if not (int(length) == length and length > 0):
            raise ValueError(f"make_workload {name}: length must be a positive integer, "
                             f"got {length!r}")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"make_workload {name}: weight must be positive and finite, "
                             f"got {weight!r} for length {length}")
    lengths = np.array([int(length) for length, _ in pairs], dtype=np.int64)
    weights = np.array([float(weight) for _, weight in pairs], dtype=np.float64)
    return lengths, weights / weights.sum()


def random_streams(seed: int) -> tuple[np.random.Generator, ...]:
    """The independent (arrivals, prompt lengths, output lengths) streams of `seed`."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def poisson_arrivals(rng: np.random.Generator, num_requests: int, rate: float) -> np.ndarray:
    """Arrival times of `num_requests` at `rate` req/s, the first at t=0 (all at 0 for
    an infinite rate); unit gaps divided by `rate`, so one seed at two rates is one
    arrival sequence on two time scales."""
    gaps = rng.standard_exponential(num_requests)
    if math.isinf(rate):
        return np.zeros(num_requests)
    # Gap i separates request i from i+1, so request 0 arrives at t=0.
    return np.concatenate([[0.0], np.cumsum(gaps[:-1] / rate)])[:num_requests]


def make_workload(num_requests: int, rate: float, prompt_mix: Union[str, LengthMix],
                  output_mix: Union[str, LengthMix], seed: int) -> list[WorkloadRequest]:
    """`num_requests` requests with Poisson arrivals at `rate` req/s, sorted by arrival.

    The first request arrives at t=0; gaps are exponential with mean 1/rate, and
    `rate=inf` puts every arrival at t=0 (a burst). Prompt and output lengths are
    drawn independently from their weighted mixes (flag text or (length, weight)
    pairs). Fully determined by `seed`.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"make_workload num_requests must be an integer >= 0, "
                         f"got {num_requests!r}")
    if not rate > 0:  # also rejects NaN
        raise ValueError(f"make_workload rate must be > 0 (inf for a burst), got {rate!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"make_workload seed must be an integer, got {seed!r}")
    prompt_lengths, prompt_probs = _as_mix("prompt_mix", prompt_mix)
    output_lengths, output_probs = _as_mix("output_mix", output_mix)

    arrival_rng, prompt_rng, output_rng = random_streams(seed)
    arrivals = poisson_arrivals(arrival_rng, num_requests, rate)
    prompts = prompt_rng.choice(prompt_lengths, size=num_requests, p=prompt_probs)
    outputs = output_rng.choice(output_lengths, size=num_requests, p=output_probs)
    return [WorkloadRequest(arrival_s=float(arrivals[i]), prompt_len=int(prompts[i]),
                            output_len=int(outputs[i]), index=i)
            for i in range(num_requests)]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a shifting workload: its length mixes and how many requests."""
    prompt_lens: str
    output_lens: str
    num_requests: int


def parse_phases(text: str) -> list[Phase]:
    """`"PROMPT_MIX/OUTPUT_MIX/N;..."` -> phases, e.g. `"448/16/24;32/128:3,64:1/24"`.
    Raises ValueError naming the whole flag text and the offending phase."""
    phases = []
    for part in text.split(";"):
        pieces = part.strip().split("/")
        if len(pieces) != 3:
            raise ValueError(f"phases {text!r}: bad phase {part!r}: expected "
                             f"'prompt_mix/output_mix/num_requests'")
        prompts, outputs, count = (p.strip() for p in pieces)
        try:
            parse_length_mix(prompts)
            parse_length_mix(outputs)
        except ValueError as e:
            raise ValueError(f"phases {text!r}: bad phase {part!r}: {e}") from None
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"phases {text!r}: bad phase {part!r}: num_requests must be a "
                             f"positive integer, got {count!r}")
        phases.append(Phase(prompts, outputs, int(count)))
    return phases


def make_shift_workload(phases: Sequence[Phase], rate: float,
                        seed: int) -> list[WorkloadRequest]:
    """The phases one after the other at `rate` req/s: each phase's requests are
    `make_workload`'s (its own seed stream), its arrivals shifted to start one mean gap
    after the previous phase's last; indices run on across phases. Request i belongs to
    phase `phase_of(phases, i)`."""
    out: list[WorkloadRequest] = []
    start = 0.0
    for p, phase in enumerate(phases):
        part = make_workload(phase.num_requests, rate, phase.prompt_lens, phase.output_lens,
                             seed * 1000 + p)
        for w in part:
            out.append(WorkloadRequest(w.arrival_s + start, w.prompt_len, w.output_len,
                                       len(out)))
        start = out[-1].arrival_s + (0.0 if math.isinf(rate) else 1.0 / rate)
    return out


def phase_of(phases: Sequence[Phase], index: int) -> int:
    """The phase of request `index` of `make_shift_workload(phases, ...)`."""
    for p, phase in enumerate(phases):
        if index < phase.num_requests:
            return p
        index -= phase.num_requests
    raise ValueError(f"request {index} is beyond the phases' requests")
