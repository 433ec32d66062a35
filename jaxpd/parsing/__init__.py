"""Model output as a chat API answers it: tool calls per model family
(`tool_calls`), reasoning split from the answer (`reasoning`), both whole and
streamed, combined per output by `OutputParser` (`output`). Plain Python: every front
end (HTTP, gRPC, the library) uses it."""
from jaxpd.parsing.output import OutputDelta, OutputParser, output_parser, parse_output
from jaxpd.parsing.reasoning import REASONING_PARSERS, ReasoningParser, split_reasoning
from jaxpd.parsing.tool_calls import (TOOL_CALL_PARSERS, ToolCall, ToolCallDelta,
                                      ToolCallParser, parse_tool_calls, tool_parser_for)

__all__ = ["OutputDelta", "OutputParser", "output_parser", "parse_output",
           "REASONING_PARSERS", "ReasoningParser", "split_reasoning",
           "TOOL_CALL_PARSERS", "ToolCall", "ToolCallDelta", "ToolCallParser",
           "parse_tool_calls", "tool_parser_for"]
