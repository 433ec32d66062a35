"""Padded sizes shared by the engine and the wire (plain Python, no jax)."""
from __future__ import annotations


def coarse_ceil(n: int) -> int:
    """`n` rounded up to the next of 1..8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...: four
    steps per power of two, so a size padded to it wastes at most a quarter of itself
    while the number of distinct sizes (one compiled program each) grows with the
    logarithm of the largest. A handoff carries `coarse_ceil` of its pages
    (`transfer.connector.KVHandoff`), and a decode step's context width is a multiple
    of it (`engine.scheduling.buckets.context_width`)."""
    if n < 1:
        raise ValueError(f"coarse_ceil needs a positive count, got {n}")
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def coarse_sizes(most: int) -> list[int]:
    """Every `coarse_ceil(n)` for n in 1..most, ascending."""
    return sorted({coarse_ceil(n) for n in range(1, most + 1)})
