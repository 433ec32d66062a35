"""Token sampling inside the jitted programs: penalties, greedy, temperature, top-k,
top-p, min-p, and the log-probabilities a request asks for.

Every option is a per-row array (`SamplingArrays`), so requests with different options
share one compiled program. The work an option costs runs under `lax.cond` on "some
row uses it" (one branch executes at run time), so a batch of plain greedy rows costs
what it did before the option existed, and samples the same tokens bit for bit.

Each row's key is `fold_in(key(seed), position)`: it depends on the request's seed and
the position of the token being drawn only, so a seeded request samples the same
tokens whatever batch, slot or shard it lands in, and after a preemption/recompute.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.engine.programs.penalties import apply_penalties, has_penalty
from jaxpd.request import Request, TokenLogprobs
from jaxpd.sampling_params import MAX_LOGPROBS


# The XLA of jax 0.6.0 (the oldest we support) aborts partitioning `lax.top_k` over a
# tp-sharded vocabulary inside the decode step's partly manual shard_map; 0.10.2 (the
# newest we test) does not. Between them we take the safe path, a full stable sort,
# which costs more, and only on steps where some row asks for them.
_TOP_K_IN_SHARD_MAP = jax.__version_info__ >= (0, 10)


class _Column:
    """One named column of a `SamplingArrays` array: a view, so the host writes
    through it and a program reads it as [B]."""

    def __init__(self, array: str, index: int):
        self.array, self.index = array, index

    def __get__(self, obj, objtype=None):
        return getattr(obj, self.array)[:, self.index]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling inputs: numpy on the host, device arrays inside a program.
    Two arrays rather than one per option: a step's inputs cost one transfer each."""
    floats: np.ndarray        # f32 [B, 6]
    ints: np.ndarray          # i32 [B, 4]

    temperature = _Column("floats", 0)
    top_p = _Column("floats", 1)
    min_p = _Column("floats", 2)
    repetition_penalty = _Column("floats", 3)
    presence_penalty = _Column("floats", 4)
    frequency_penalty = _Column("floats", 5)
    top_k = _Column("ints", 0)
    seed = _Column("ints", 1)             # uint32 bits (see `set_row`)
    num_logprobs = _Column("ints", 2)     # -1: none asked
    # Prefill only: a row's tokens from here on are output it generated before (a
    # recompute), counted by the presence and frequency penalties.
    prompt_len = _Column("ints", 3)

    @classmethod
    def empty(cls, n: int) -> SamplingArrays:
        s = cls(np.zeros((n, 6), np.float32), np.zeros((n, 4), np.int32))
        s.top_p[:], s.repetition_penalty[:], s.num_logprobs[:] = 1, 1, -1
        return s

    def set_row(self, i: int, request: Request) -> None:
        p = request.params
        self.temperature[i], self.top_k[i], self.top_p[i] = p.temperature, p.top_k, p.top_p
        self.min_p[i] = p.min_p
        self.seed[i] = np.uint32((request.seed ^ (request.seed >> 32)) & 0xFFFFFFFF).view(np.int32)
        self.repetition_penalty[i] = p.repetition_penalty
        self.presence_penalty[i] = p.presence_penalty
        self.frequency_penalty[i] = p.frequency_penalty
        self.num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.prompt_len[i] = len(request.prompt_ids)

    @property
    def wants_logprobs(self) -> bool:
        """Some row asks for log-probabilities: only then are they read back."""
        return bool((self.num_logprobs >= 0).any())


class Logprobs(NamedTuple):
    """Under the raw model distribution (before penalties and temperature), per row:
    the sampled token's log-probability [B] and the `MAX_LOGPROBS` most likely tokens
    [B, K], best first. Zeros when no row asked."""
    sampled: jnp.ndarray       # f32 [B]
    top_ids: jnp.ndarray       # i32 [B, K]
    top_values: jnp.ndarray    # f32 [B, K]

    def of_row(self, i: int, request: Request) -> TokenLogprobs | None:
        """Row `i` (host arrays) as its request asked for them: its top `logprobs`."""
        n = request.params.logprobs
        if n is None:
            return None
        return float(self.sampled[i]), tuple(zip(self.top_ids[i, :n].tolist(),
                                                 self.top_values[i, :n].tolist()))


def sample(logits_BV: jnp.ndarray, s: SamplingArrays, positions_B: jnp.ndarray,
           context: Callable[[], tuple[jnp.ndarray, jnp.ndarray]]
           ) -> tuple[jnp.ndarray, Logprobs]:
    """Next token per row [B] (int32; temperature 0 -> argmax, exact greedy) and the
    log-probabilities. `context()` gives the penalties' inputs, (output token counts
    i32 [B, V], prompt presence bool [B, V]); it is called only in the branch that runs
    when some row has a penalty."""
    raw = logits_BV.astype(jnp.float32)
    greedy = jnp.argmax(raw, axis=-1).astype(jnp.int32)
    penalised, drawn = jnp.any(has_penalty(s)), jnp.any(s.temperature > 0)

    def choose(logits, greedy):
        # The vocabulary sort in `_draw` costs more than a small model's whole step on
        # CPU: skip it when every row is greedy.
        return jax.lax.cond(drawn, lambda: _draw(logits, greedy, s, positions_B),
                            lambda: greedy)

    def with_penalties():
        logits = apply_penalties(raw, s, *context())
        return choose(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32))

    # Branches return tokens [B], never logits [B, V]: a branch that passes an operand
    # through would copy it on every step.
    tokens = jax.lax.cond(penalised | drawn, lambda: jax.lax.cond(
        penalised, with_penalties, lambda: choose(raw, greedy)), lambda: greedy)
    k = min(MAX_LOGPROBS, raw.shape[-1])
    # Zeros shaped after `raw`, so they vary over "dp" inside shard_map as it does.
    none = lambda: Logprobs(jnp.zeros_like(raw[:, 0]), jnp.zeros_like(raw[:, :k], jnp.int32),
                            jnp.zeros_like(raw[:, :k]))
    logprobs = jax.lax.cond(jnp.any(s.num_logprobs >= 0),
                            lambda: _logprobs(raw, tokens, k), none)
    return tokens, logprobs


def _draw(logits, greedy, s: SamplingArrays, positions_B):
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    # One descending sort serves both filters.
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    vocab = logits.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)           # [B, 1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < s.top_p[:, None]
    last_kept = jnp.sum(keep, axis=-1, keepdims=True) - 1
    pth = jnp.take_along_axis(sorted_desc, last_kept, axis=-1)
    # min_p: p >= min_p * p_max, i.e. scaled >= max + log(min_p) (log 0 = -inf: off).
    # A ratio of probabilities: the same before or after top-k/top-p renormalise.
    mth = sorted_desc[:, :1] + jnp.log(s.min_p)[:, None]
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    filtered = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(
        jax.lax.bitcast_convert_type(s.seed, jnp.uint32), positions_B)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return jnp.where(s.temperature > 0, drawn, greedy)


def _logprobs(raw, tokens, k: int) -> Logprobs:
    log_p = jax.nn.log_softmax(raw, axis=-1)
    if _TOP_K_IN_SHARD_MAP:
        top_values, top_ids = jax.lax.top_k(log_p, k)
    else:
        iota = jax.lax.broadcasted_iota(jnp.int32, log_p.shape, 1)
        neg, ids = jax.lax.sort((-log_p, iota), dimension=1, is_stable=True, num_keys=1)
        top_values, top_ids = -neg[:, :k], ids[:, :k]
    sampled = jnp.take_along_axis(log_p, tokens[:, None], axis=-1)[:, 0]
    return Logprobs(sampled, top_ids.astype(jnp.int32), top_values)
