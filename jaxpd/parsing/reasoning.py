"""A reasoning model's thinking, split from its answer: Qwen3's (and DeepSeek-R1's)
`<think>...</think>` at the start of the output goes to `reasoning_content`.

Whole (`split_reasoning`) or streamed (`ReasoningParser.feed` / `finish`), with the
same result for any chunking of the text. When the chat template has opened `<think>`
in the prompt itself, the output starts inside the reasoning (`starts_inside`).
Whitespace between `</think>` and the answer is dropped. Plain Python.
"""
from __future__ import annotations

from jaxpd.parsing.markers import partial_marker_len

REASONING_PARSERS = ("auto", "qwen3", "none")
THINK_START, THINK_END = "<think>", "</think>"

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


def reasoning_parser_for(name: str, chat_template: str | None) -> str:
    """The parser `name` (one of REASONING_PARSERS) means for a model with this chat
    template: "auto" is "qwen3" when the template speaks of `<think>`, else "none"."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; one of "
                         f"{', '.join(REASONING_PARSERS)}")
    if name == "auto":
        return "qwen3" if chat_template and THINK_START in chat_template else "none"
    return name


def starts_inside(prompt: str) -> bool:
    """Whether the prompt leaves the model inside a `<think>` block (the template
    opened it for the model)."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningParser:
    """Splits one output into (reasoning, content) as its text arrives. Reasoning is
    recognised only at the very start of the output (after whitespace), as Qwen3
    writes it; later `<think>` text is content."""

    def __init__(self, inside: bool = False):
        self._state = _INSIDE if inside else _BEFORE
        self._buf = ""              # received, not yet sent
        self._drop_space = False    # right after </think>

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` more makes certain."""
        self._buf += text
        reasoning = content = ""
        while True:
            if self._state == _BEFORE:
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf = head[len(THINK_START):]
                    self._state = _INSIDE
                elif THINK_START.startswith(head):      # empty or a beginning of <think>
                    return reasoning, content
                else:
                    self._state = _AFTER
            elif self._state == _INSIDE:
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = partial_marker_len(self._buf, (THINK_END,))
                    reasoning += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return reasoning, content
                reasoning += self._buf[:end]
                self._buf = self._buf[end + len(THINK_END):]
                self._state, self._drop_space = _AFTER, True
            else:
                if self._drop_space:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return reasoning, content
                    self._drop_space = False
                content += self._buf
                self._buf = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of the text held back: the output has ended. Thinking
        cut short (no `</think>`) is all reasoning."""
        rest, self._buf = self._buf, ""
        if self._state == _INSIDE:
            return rest, ""
        if self._state == _AFTER and self._drop_space:
            return "", ""
        return "", rest


def split_reasoning(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole output."""
    parser = ReasoningParser(inside)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
