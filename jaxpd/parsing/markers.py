"""Text that may still grow into a marker: what a streaming parser holds back."""
from __future__ import annotations

from typing import Sequence


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of
    `markers` (0 if none): those characters may turn out to be a marker once more text
    arrives, so they must not be sent yet."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest
