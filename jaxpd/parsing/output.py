"""One output's text as what a chat API answers: reasoning, content and tool calls.

`OutputParser` runs the reasoning split first (thinking comes before the answer) and
the tool-call parser on the answer; fed the text as it is generated, it gives each
step's `OutputDelta`, and at the end holds the whole result (`reasoning`, `content`,
`calls`), equal to what the deltas add up to. Front ends (HTTP, gRPC, the library)
build one per output with `output_parser`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpd.parsing.reasoning import ReasoningParser, reasoning_parser_for, starts_inside
from jaxpd.parsing.tool_calls import (ToolCall, ToolCallDelta, ToolCallParser,
                                      make_tool_parser, new_call_id, tool_parser_for)


@dataclasses.dataclass(frozen=True)
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """Reasoning (None: no split) then tool calls (None: none parsed) of one output."""

    def __init__(self, reasoning: ReasoningParser | None = None,
                 tools: ToolCallParser | None = None):
        self._reasoning, self._tools = reasoning, tools
        self.reasoning = self.content = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> OutputDelta:
        """What `text` more makes certain."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        content, calls = self._tools.feed(content) if self._tools else (content, [])
        return self._add(reasoning, content, calls)

    def finish(self) -> OutputDelta:
        """The rest: the output has ended."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            more, last = self._tools.finish()
            content, calls = content + more, calls + last
        return self._add(reasoning, content, calls)

    def _add(self, reasoning: str, content: str, calls: list[ToolCallDelta]) -> OutputDelta:
        self.reasoning += reasoning
        self.content += content
        return OutputDelta(reasoning, content, tuple(calls))


def output_parser(chat_template: str | None, prompt: str, tool_call_parser: str = "auto",
                  reasoning_parser: str = "auto", parse_tools: bool = True,
                  max_calls: int | None = None,
                  new_id: Callable[[], str] = new_call_id) -> OutputParser:
    """The parser of one chat output: parsers named as in `TOOL_CALL_PARSERS` and
    `REASONING_PARSERS` ("auto": chosen from `chat_template`); `prompt`: the rendered
    prompt (it may open the reasoning); `parse_tools` False: no calls (no tools in the
    request, or `tool_choice: "none"`). ValueError for an unknown parser name."""
    tool_name = tool_parser_for(tool_call_parser, chat_template)
    reasoning_name = reasoning_parser_for(reasoning_parser, chat_template)
    reasoning = (ReasoningParser(starts_inside(prompt)) if reasoning_name != "none"
                 else None)
    tools = make_tool_parser(tool_name, new_id, max_calls) if parse_tools else None
    return OutputParser(reasoning, tools)


def parse_output(text: str, parser: OutputParser) -> OutputParser:
    """`parser` after a whole output's text: read `.reasoning`, `.content`, `.calls`."""
    parser.feed(text)
    parser.finish()
    return parser
