"""Repetition, presence and frequency penalties: the context they read and how they
bend the logits (as vLLM does, before temperature).

A row's context is two [V] vectors: how often each token occurs in its output so far
(int32 counts: presence and frequency penalties, and repetition with the prompt) and
whether it occurs in its prompt (bool: repetition penalty only).

- Prefill builds them in-program from the token batch (`prefill_context`): the prompt
  up to the row's prompt length, the rest (a recompute's output so far) counted.
- Decode keeps them per slot on the decode mesh (`SlotPenalties`, [num_slots, V]
  split over "dp" like the slots). A slot's rows are written when a request with
  penalties is inserted (`set_slot`, from its prompt and output so far, also after a
  preemption); the step adds each sampled token to its row's counts in place
  (`count_sampled`, into the donated array). Rows of requests without penalties are
  never read, so they are never kept up to date.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.sharding.compat import shard_map


def has_penalty(s) -> jnp.ndarray:
    """bool [B]: the row's request has some penalty (`SamplingArrays` `s`)."""
    return ((s.repetition_penalty != 1) | (s.presence_penalty != 0)
            | (s.frequency_penalty != 0))


def apply_penalties(logits, s, counts, prompt) -> jnp.ndarray:
    """logits f32 [B, V] penalised: repetition r over tokens seen in prompt or output
    (a positive logit / r, a negative one * r), then frequency * count and presence *
    (count > 0) over the output subtracted. Neutral values leave a row's logits
    unchanged bit for bit (x / 1, x * 1, x - 0)."""
    in_output = counts > 0
    r = s.repetition_penalty[:, None]
    logits = jnp.where(prompt | in_output, jnp.where(logits > 0, logits / r, logits * r), logits)
    return (logits - s.frequency_penalty[:, None] * counts
            - s.presence_penalty[:, None] * in_output)


def prefill_context(tokens_BT, lengths_B, prompt_lens_B, vocab: int):
    """(output counts i32 [B, V], prompt presence bool [B, V]) of a prefill batch:
    positions below `prompt_lens` are prompt, those from it up to `lengths` output
    already generated (a recompute), padding neither."""
    b, t = tokens_BT.shape
    pos = jnp.arange(t)[None, :]
    real = pos < lengths_B[:, None]
    output = real & (pos >= prompt_lens_B[:, None])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    zeros = jnp.zeros((b, vocab), jnp.int32)
    counts = zeros.at[rows, tokens_BT].add(output.astype(jnp.int32))
    in_prompt = zeros.at[rows, tokens_BT].add((real & ~output).astype(jnp.int32))
    return counts, in_prompt > 0


def count_sampled(counts, rows_B, tokens_B, s) -> jnp.ndarray:
    """counts i32 [slots, V] with each penalised row's sampled token added to its slot
    `rows[b]`'s counts (B scattered elements, in place in a donated array: nothing
    worth a branch); a row whose slot is out of range (padding) adds nothing."""
    return counts.at[rows_B, tokens_B].add(has_penalty(s).astype(jnp.int32), mode="drop")


class SlotPenalties:
    """The decode slots' penalty context: `counts` i32 and `prompt` bool, both
    [num_slots, V] and split over "dp" like the slots. The step donates `counts` and
    returns it updated (`count_sampled`); `set_slot` rewrites one slot's rows."""

    def __init__(self, mesh: Mesh, num_slots: int, vocab: int):
        self.mesh, self.vocab = mesh, vocab
        self.num_shards = mesh.shape["dp"]
        self.slots_per_shard = num_slots // self.num_shards
        self.sharding = NamedSharding(mesh, P("dp"))
        self._replicated = NamedSharding(mesh, P())
        shape = (num_slots, vocab)
        self.counts = jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=self.sharding)()
        self.prompt = jax.jit(lambda: jnp.zeros(shape, bool), out_shardings=self.sharding)()

        def set_row(counts, prompt, target, row_counts, row_prompt):
            # One shard's rows [slots_per_shard, V]; `target` [1] is the local slot to
            # write on the shard that holds it, -1 on the others (they write back the
            # row they have).
            i = jnp.maximum(target[0], 0)
            mine = target[0] >= 0
            put = lambda x, row: jax.lax.dynamic_update_index_in_dim(
                x, jnp.where(mine, row, x[i]), i, 0)
            return put(counts, row_counts), put(prompt, row_prompt)

        slot = P("dp")
        self._set_row = jax.jit(shard_map(
            set_row, mesh=mesh, axis_names={"dp"}, in_specs=(slot, slot, slot, P(), P()),
            out_specs=(slot, slot)), donate_argnums=(0, 1),
            out_shardings=(self.sharding, self.sharding))

    def set_slot(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Slot `slot`'s rows from its request's prompt and output so far. The rows are
        built on the host ([V] each, once per insert) so one program serves every length."""
        self.counts, self.prompt = self._set_row(*self.set_slot_args(slot, prompt_ids, output_ids))

    @property
    def set_row_program(self):
        """The jitted program `set_slot` dispatches (`set_slot_args` are its arguments)."""
        return self._set_row

    def set_slot_args(self, slot: int, prompt_ids: list[int], output_ids: list[int]):
        row_counts = np.bincount(np.asarray(output_ids, np.int64), minlength=self.vocab
                                 ).astype(np.int32)
        row_prompt = np.zeros(self.vocab, bool)
        row_prompt[np.asarray(prompt_ids, np.int64)] = True
        target = np.full(self.num_shards, -1, np.int32)
        target[slot // self.slots_per_shard] = slot % self.slots_per_shard
        target = jax.device_put(target, self.sharding)
        rows = jax.device_put((row_counts, row_prompt), self._replicated)
        return (self.counts, self.prompt, target, *rows)
