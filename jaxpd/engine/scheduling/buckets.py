"""Bucket arithmetic (plain Python, no jax): the padded lengths, batch sizes and
context widths the programs are compiled for, one program per value. The schedulers
pad to them, warm-up compiles them, and `EngineConfig.buckets` reads them without
loading a scheduler.
"""
from __future__ import annotations

from jaxpd.sizes import coarse_ceil


def length_buckets(max_len: int, min_bucket: int = 16) -> list[int]:
    """Powers of two from `min_bucket` up to the first one >= max_len."""
    buckets = [min_bucket]
    while buckets[-1] < max_len:
        buckets.append(buckets[-1] * 2)
    return buckets


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two below max_batch, then max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def decode_batch_sizes(slots_per_shard: int, from_one: bool = False) -> list[int]:
    """Rows per dp shard a decode step may run (one program each): powers of two from
    a quarter of the slots (at least 1) up to all of them. A step runs the fewest that
    hold its busiest shard's slots, so one stream among many slots costs a quarter of
    a full step's rows, not all of them, in three or four programs. `from_one`: from 1
    row, for a step whose cost grows with its rows even when it is small (the native
    product of quantized weights computes every row, padding too, where a float
    step's cost is the weights it reads)."""
    low = 1 if from_one else max(1, slots_per_shard // 4)
    return [s for s in batch_buckets(slots_per_shard) if s >= low]


def context_width(num_pages: int, step: int, max_pages: int, by_length: bool = False) -> int:
    """Pages of context one decode step computes when its longest slot holds
    `num_pages`; each width is one compiled program.

    `by_length`: the attention core reads each slot's pages only up to its own length
    (the native and Pallas kernels), so the block table's width costs nothing and one
    width, `max_pages`, serves every step. Otherwise (the jnp reference gathers the
    whole width) the width is `step` times `coarse_ceil` of the context in steps, at
    most `max_pages`: within a quarter of the real context, in few programs."""
    if by_length:
        return max_pages
    steps = -(-max(num_pages, 1) // step)
    return min(coarse_ceil(steps) * step, max_pages)


def context_widths(step: int, max_pages: int, by_length: bool = False) -> list[int]:
    """Every width `context_width` can return (what warm-up compiles)."""
    return sorted({context_width(n, step, max_pages, by_length) for n in range(1, max_pages + 1)})
