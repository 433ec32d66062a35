"""A request's output as text: incremental detokenisation with stop strings.

Plain Python (no jax). The engine that samples a request's tokens watches its stop
strings (`StopText`, so the request ends -- and frees its slot -- on the token that
completes one); every front end renders the text the same way (`TextStream`): the
text is cut before the first stop string, and while streaming, the last few
characters that could still be the start of a stop string are held back until the
next token says whether they are.
"""
from __future__ import annotations

from typing import Sequence

from jaxpd.models.tokenizer import IncrementalDecoder


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string in `text` begins (searching from `start`), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class TextStream:
    """Text deltas of one request's output ids with its stop strings applied."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self._decoder = IncrementalDecoder(tokenizer)
        self._stops = tuple(stops)
        self._hold = max(map(len, self._stops), default=1) - 1
        self.text = ""              # decoded so far (may run past a stop string)
        self.stop_at: int | None = None   # where the first stop string begins
        self._sent = 0

    def push(self, ids: Sequence[int]) -> str:
        """The new text that is certain to be output, given `ids` more tokens."""
        self._add(self._decoder.push(list(ids)) if ids else "")
        end = self.stop_at if self.stop_at is not None else len(self.text) - self._hold
        return self._send(end)

    def finish(self) -> str:
        """The rest of the output text (the request has ended)."""
        self._add(self._decoder.flush())
        return self._send(self.stop_at if self.stop_at is not None else len(self.text))

    def _add(self, delta: str) -> None:
        if self.stop_at is not None or not delta:
            return
        start = max(len(self.text) - self._hold, 0)
        self.text += delta
        if self._stops:
            self.stop_at = find_stop(self.text, self._stops, start)

    def _send(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out


class StopText:
    """Engine side: True from `push` once the output contains a stop string."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self._stream = TextStream(tokenizer, stops)

    def push(self, ids: Sequence[int]) -> bool:
        self._stream.push(ids)
        return self._stream.stop_at is not None


def output_text(tokenizer, ids: Sequence[int], stops: Sequence[str] = ()) -> str:
    """The whole output text of `ids`, cut before the first stop string."""
    stream = TextStream(tokenizer, stops)
    return stream.push(ids) + stream.finish()
