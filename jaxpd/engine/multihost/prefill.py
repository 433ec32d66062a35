"""A prefill mesh across processes (`engine.multihost`): the leader's prefill runner,
which publishes each program it dispatches (`LeaderPrefillRunner`), and a follower's
replay of those calls (`PrefillReplay`) -- for a prefill role, and for the decode
mesh's own prefill of a decode role (`multihost.decode`). With per-shard offers
(`shard_offers`) the pages stay where they were computed and each process offers its
own; else they are gathered for the leader to send.
"""
from __future__ import annotations

import secrets

import numpy as np

from jaxpd.engine.multihost.plan_channel import PlanChannel, PlanError, pack_array, unpack_array
from jaxpd.engine.programs.sampler import SamplingArrays


class LeaderPrefillRunner:
    """A `PrefillRunner` whose every program dispatch is published first, so followers
    dispatch the same one. Pages come back, for the connector to send, as this
    process's own copy of the gathered, replicated array (built with
    `gather_pages=True`), or, with per-shard offers (`channel.offers`, a
    `shard_offers.Board`), where they were computed (`ShardedPages`): each process
    then offers its own shards. Anything else is the wrapped runner's."""

    def __init__(self, runner, channel: PlanChannel):
        self._runner, self.channel = runner, channel
        self.board = channel.offers

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def run(self, tokens: np.ndarray, lengths: np.ndarray, sampling: SamplingArrays):
        self.channel.publish({"op": "run", "tokens": pack_array(tokens),
                              "lengths": pack_array(lengths),
                              "floats": pack_array(sampling.floats),
                              "ints": pack_array(sampling.ints)})
        return self._runner.run(tokens, lengths, sampling)

    def take_rows(self, k, v, rows: list[tuple[int, int, int]]):
        if not rows:
            return []
        base = secrets.randbits(63)
        self.channel.publish({"op": "take", "rows": [list(r) for r in rows], "base": base})
        pages = self._runner.take_rows(k, v, rows)
        if self.board is not None:
            return self.board.wrap(base, 0, pages)
        return [(_local(k_pages), _local(v_pages)) for k_pages, v_pages in pages]

    def take_pages(self, k, v, row: int, num_pages: int, first_page: int = 0):
        return self.take_rows(k, v, [(row, first_page, num_pages)])[0]

    def run_layerwise(self, tokens, lengths, sampling, groups, rows):
        base = secrets.randbits(63)
        self.channel.publish({"op": "layerwise", "base": base, "tokens": pack_array(tokens),
                              "lengths": pack_array(lengths),
                              "floats": pack_array(sampling.floats),
                              "ints": pack_array(sampling.ints),
                              "groups": [list(g) for g in groups],
                              "rows": [list(r) for r in rows]})
        first, logprobs, parts = self._runner.run_layerwise(tokens, lengths, sampling, groups,
                                                            rows)
        if self.board is not None:
            return first, logprobs, [self.board.wrap(base, g, group)
                                     for g, group in enumerate(parts)]
        return first, logprobs, [[(_local(k), _local(v)) for k, v in group] for group in parts]


def _local(x):
    """This process's copy of a replicated global array."""
    return x.addressable_data(0)


def _batch(msg: dict):
    """A run message's (tokens, lengths, sampling rows), checked."""
    tokens, lengths, floats, ints = (unpack_array(msg.get(name), name)
                                     for name in ("tokens", "lengths", "floats", "ints"))
    b = tokens.shape[0] if tokens.ndim == 2 else -1
    if b < 1 or lengths.shape != (b,) or floats.shape != (b, 6) or ints.shape != (b, 4) or \
            tokens.dtype != np.int32 or lengths.dtype != np.int32 or floats.dtype != np.float32:
        raise PlanError("plan batch: tokens [B, T], lengths [B], floats [B, 6], ints [B, 4]")
    return tokens, lengths, SamplingArrays(floats, ints.astype(np.int32))


def _pairs(value, name: str, width: int) -> list[tuple[int, ...]]:
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == width and
            all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in p)
            for p in value):
        raise PlanError(f"plan field {name}: expected lists of {width} non-negative ints")
    return [tuple(p) for p in value]


def _base(msg: dict) -> int:
    base = msg.get("base")
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < 1 << 63:
        raise PlanError("plan field base: expected an int in [0, 2**63)")
    return base


class PrefillReplay:
    """A follower's replay of a `LeaderPrefillRunner`'s calls on `runner` (a
    `PrefillRunner` built as the leader's is); with per-shard offers (`offers`, a
    `shard_offers.Offerer`) it also offers this process's pieces of every row cut,
    and ends those the leader says nobody pulled. `__call__` raises PlanError for a
    message that is not one of them."""

    OPS = ("run", "take", "layerwise", "reclaim")

    def __init__(self, runner, offers=None):
        self.runner, self.offers, self._kv = runner, offers, None

    def __call__(self, msg: dict) -> None:
        import jax

        op = msg["op"]
        if op == "run":
            _, _, *self._kv = self.runner.run(*_batch(msg))
        elif op == "take":
            if self._kv is None:
                raise PlanError("plan take before any run")
            rows = _pairs(msg.get("rows"), "rows", 3)
            if any(n < 1 for _, _, n in rows):
                raise PlanError("plan field rows: a row takes at least one page")
            pages = jax.block_until_ready(self.runner.take_rows(*self._kv, rows))
            if self.offers is not None:
                self.offers.offer(_base(msg), 0, pages)
        elif op == "layerwise":
            groups = _pairs(msg.get("groups"), "groups", 2)
            rows = _pairs(msg.get("rows"), "rows", 3)
            *_, parts = self.runner.run_layerwise(*_batch(msg), groups, rows)
            base = _base(msg) if self.offers is not None else None
            for g, group in enumerate(parts):     # each group's as soon as it is computed
                jax.block_until_ready(group)
                if base is not None:
                    self.offers.offer(base, g, group)
        elif op == "reclaim" and self.offers is not None:
            uuids = msg.get("uuids")
            if not isinstance(uuids, list) or len(uuids) > 4096 or not all(
                    isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 63
                    for u in uuids):
                raise PlanError("plan field uuids: expected a list of uuids")
            self.offers.reclaim(uuids)
        else:
            raise PlanError(f"plan op {op!r} is not one a leader sends")
