"""Tool calls in a model's output text, in each model family's own format.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
  as many as the model writes, anywhere in the text.
- `llama3_json` (Llama 3.1-3.3): the output is a JSON object `{"name": ...,
  "parameters"|"arguments": ...}`, perhaps after `<|python_tag|>`, several separated
  by `;`; a call is recognised only at the start of the output, as Meta's format has it.
- `mistral`: `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` objects
  (or that array opening the output: decoding skips `[TOOL_CALLS]` where the tokenizer
  makes it a special token).
- `json`: the fallback: any JSON object in the text with exactly a `name` and its
  `arguments` (or `parameters`).

`tool_parser_for` chooses one from the chat template's text (`auto`).

Each parser works whole (`parse_tool_calls`) and streamed (`ToolCallParser.feed` /
`finish`): text that may still become part of a call (a beginning of a start marker,
an unfinished call) is held back, so nothing sent as content is ever taken back, and
any chunking of the same text gives the same content and calls. A call is sent once its
JSON is complete, as OpenAI's streamed deltas: one with `index`, `id` and the name,
then one with the arguments. Without constrained decoding the JSON may be malformed;
then the whole call text, markers included, is left as content (nothing is lost, and
the client sees what the model wrote). Whitespace before a call, and after the last
one, belongs to the call. Plain Python.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Callable

from jaxpd.parsing.markers import partial_marker_len

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "json", "none")

_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}
_SPACE = " \t\r\n"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI sends it."""
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first of a call has `id` and `name`."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclasses.dataclass(frozen=True)
class Family:
    """How one model family writes calls. `starts`: the markers that open a call
    anywhere (`{` or `[` opens the JSON itself); `openings`: those that open one only
    at the start of the output (or right after a call, past `separators`); `end`: the
    marker that closes a call (None: the JSON value's end does); `arrays`: a JSON array
    holds several calls; `needs_arguments`: an object without `arguments`/`parameters`
    is not a call (where no marker says it is one)."""
    name: str
    starts: tuple[str, ...] = ()
    end: str | None = None
    openings: tuple[str, ...] = ()
    separators: str = ""
    arrays: bool = False
    needs_arguments: bool = False


FAMILIES = {f.name: f for f in (
    Family("hermes", ("<tool_call>",), end="</tool_call>"),
    Family("llama3_json", openings=("<|python_tag|>", "{"), separators=";",
           needs_arguments=True),
    # [TOOL_CALLS] is a special token to newer Mistral tokenizers, which decoding skips:
    # then the output opens with the array itself
    Family("mistral", ("[TOOL_CALLS]",), openings=("[",), arrays=True),
    Family("json", ("{",), needs_arguments=True),
)}


def tool_parser_for(name: str, chat_template: str | None) -> str:
    """The parser `name` (one of TOOL_CALL_PARSERS) means for a model with this chat
    template: "auto" looks for each family's markers in the template, and falls back to
    "json". ValueError for an unknown name."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    if name != "auto":
        return name
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>ipython" in template:
        return "llama3_json"
    return "json"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at `text[start]` ends (the index after
    its closing bracket), or None while it is unfinished. Strings are skipped, so
    brackets inside them do not count; whether the JSON is valid is checked later."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ToolCallParser:
    """Splits one output into content and tool calls as its text arrives.
    `new_id`: makes each call's id; `max_calls`: calls past this many are left as
    content (`parallel_tool_calls: false` asks for one)."""

    def __init__(self, family: Family, new_id: Callable[[], str] = new_call_id,
                 max_calls: int | None = None):
        self.family = family
        self.calls: list[ToolCall] = []
        self._new_id, self._max_calls = new_id, max_calls
        self._buf = ""             # received, not yet sent
        self._marker: str | None = None   # the marker of the call being read
        self._possible = True      # may a call still begin (max_calls, or no openings left)
        self._at_start = bool(family.openings)   # may one of `openings` still open a call
        self._after_call = False   # only space (and separators) since the last call
        self._space = ""           # whitespace before the call being read: content if it is not one

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) that `text` more makes certain."""
        self._buf += text
        content, deltas = "", []
        while True:
            step = self._call_step() if self._marker else self._text_step()
            if step is None:
                return content, deltas
            content += step[0]
            deltas += step[1]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) of the text held back: the output has ended. A call
        without its end marker counts if its JSON is whole; one whose JSON is cut off
        is content."""
        rest, self._buf = self._buf, ""
        if self._marker is None:
            if self._after_call and not rest.strip(_SPACE + self.family.separators):
                return "", []    # the space after the last call
            return rest, []
        if self.family.end is not None:
            read = self._read(rest[self._body_start():])
            if read is not None:
                return "", self._accept(read)
        return self._space + rest, []

    # ---- the two states ----

    def _text_step(self) -> tuple[str, list] | None:
        f = self.family
        if not self._possible:
            if not self._buf or (self._after_call and not self._buf.strip(_SPACE + f.separators)):
                return None
            out, self._buf = self._buf, ""
            return self._content(out)
        if self._at_start:
            head = self._buf.lstrip(_SPACE + (f.separators if self._after_call else ""))
            markers = f.openings + f.starts
            marker = next((m for m in markers if head.startswith(m)), None)
            if marker is not None:
                self._space = self._buf[:len(self._buf) - len(head)]
                self._buf, self._marker = head, marker
                return "", []
            if any(m.startswith(head) for m in markers):    # empty or a marker's beginning
                return None
            self._at_start = False
            self._possible = bool(f.starts)
            return "", []
        hits = [(i, m) for m in f.starts if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            out = self._buf[:i].rstrip()
            self._space = self._buf[len(out):i]
            self._buf, self._marker = self._buf[i:], marker
            return self._content(out)
        keep = partial_marker_len(self._buf, f.starts)
        sendable = self._buf[:len(self._buf) - keep].rstrip()   # trailing space may precede a call
        if not sendable:
            return None
        self._buf = self._buf[len(sendable):]
        return self._content(sendable)

    def _content(self, text: str) -> tuple[str, list]:
        if text:
            self._after_call = False
        return text, []

    def _call_step(self) -> tuple[str, list] | None:
        f, start = self.family, self._body_start()
        rest = self._buf[start:]
        opening = len(rest) - len(rest.lstrip())
        if opening == len(rest):
            return None
        if f.end is not None:
            # the end marker after the JSON: a string in it may hold the marker's text
            json_to = start
            if rest[opening] == "{":
                json_to = json_end(self._buf, start + opening)
                if json_to is None:
                    return None
            end = self._buf.find(f.end, json_to)
            if end < 0:
                return None
            region, body = self._buf[:end + len(f.end)], self._buf[start:end]
        else:
            if rest[opening] not in ("{[" if f.arrays else "{"):
                return self._not_a_call(len(self._marker))
            end = json_end(self._buf, start + opening)
            if end is None:
                return None
            region, body = self._buf[:end], self._buf[start:end]
        read = self._read(body)
        if read is None:
            return self._not_a_call(len(region))
        self._buf = self._buf[len(region):]
        self._marker = None
        return "", self._accept(read)

    def _body_start(self) -> int:
        return 0 if self._marker in ("{", "[") else len(self._marker)

    def _not_a_call(self, length: int) -> tuple[str, list]:
        """The first `length` characters are content after all: no call opens the
        output now."""
        out = self._space + self._buf[:length]
        self._buf, self._marker, self._space = self._buf[length:], None, ""
        self._at_start = False
        self._possible = bool(self.family.starts)
        return out, []

    # ---- reading a call ----

    def _read(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call `body` holds, or None if it is not calls."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        objects = value if self.family.arrays and isinstance(value, list) else [value]
        calls = [self._call(o) for o in objects]
        if not calls or None in calls:
            return None
        if self._max_calls is not None and len(self.calls) + len(calls) > self._max_calls:
            return None
        return calls

    def _call(self, obj) -> tuple[str, str] | None:
        if not isinstance(obj, dict) or not set(obj) <= _CALL_KEYS:
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        arguments = obj.get("arguments", obj.get("parameters"))
        if arguments is None:
            if self.family.needs_arguments:
                return None
            arguments = {}
        if isinstance(arguments, str):   # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)

    def _accept(self, read: list[tuple[str, str]]) -> list[ToolCallDelta]:
        deltas = []
        for name, arguments in read:
            call = ToolCall(self._new_id(), name, arguments)
            index = len(self.calls)
            self.calls.append(call)
            deltas += [ToolCallDelta(index, call.id, name),
                       ToolCallDelta(index, arguments=arguments)]
        self._after_call, self._space = True, ""
        self._at_start = bool(self.family.openings and self.family.separators)
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            self._possible = False
        return deltas


def make_tool_parser(name: str, new_id: Callable[[], str] = new_call_id,
                     max_calls: int | None = None) -> ToolCallParser | None:
    """A parser of the family `name` (resolved: not "auto"); None for "none"."""
    if name == "none":
        return None
    if name not in FAMILIES:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}")
    return ToolCallParser(FAMILIES[name], new_id, max_calls)


def parse_tool_calls(text: str, name: str, new_id: Callable[[], str] = new_call_id,
                     max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output with parser `name` (resolved)."""
    parser = make_tool_parser(name, new_id, max_calls)
    if parser is None:
        return text, []
    c1, _ = parser.feed(text)
    c2, _ = parser.finish()
    return c1 + c2, parser.calls
