"""Tool calls and reasoning in model output (`jaxpd.parsing`): hand-written outputs in
each family's format, parsed whole and streamed in every chunking."""
import itertools
import json
import random

import pytest

from jaxpd.parsing import (OutputParser, ReasoningParser, ToolCall, output_parser,
                           parse_output, parse_tool_calls, split_reasoning, tool_parser_for)
from jaxpd.parsing.markers import partial_marker_len
from jaxpd.parsing.tool_calls import make_tool_parser


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(i, name, **arguments):
    return ToolCall(f"call_{i}", name, json.dumps(arguments, ensure_ascii=False))


# (parser, model output, content, calls): what each family's models write.
GOLDEN = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "Let me check.", [call(0, "get_weather", city="Paris", unit="celsius")]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "b", "arguments": {"s": "</tool_call> is text"}}\n'
               '</tool_call>',
     "", [call(0, "a", x=1), call(1, "b", s="</tool_call> is text")]),
    ("hermes", "No tools needed: 2 + 2 = 4. A <tag> is not <tool_call", "No tools needed: "
     "2 + 2 = 4. A <tag> is not <tool_call", []),
    # bad JSON: left as content
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>\nSorry.',
     '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>\nSorry.', []),
    # no end marker, but the JSON is whole: a call
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"q": "ü"}}',
     "", [call(0, "f", q="ü")]),
    ("hermes", '<tool_call>\n{"name": "f", "argum',                        # cut off mid-call
     '<tool_call>\n{"name": "f", "argum', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [call(0, "get_weather", city="Oslo")]),
    ("llama3_json", '\n{"type": "function", "name": "a", "parameters": {}}; '
                    '{"name": "b", "arguments": "{\\"n\\": 2}"}',
     "", [call(0, "a"), call(1, "b", n=2)]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", 'Here: {"name": "a", "parameters": {}}',
     'Here: {"name": "a", "parameters": {}}', []),
    ("mistral", 'Checking both.[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, 2]}}, '
                '{"name": "b", "arguments": {}}]',
     "Checking both.", [call(0, "a", x=[1, 2]), call(1, "b")]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, 42]',
     '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, 42]', []),
    ("mistral", '[TOOL_CALLS] not json', "[TOOL_CALLS] not json", []),
    ("mistral", ' [{"name": "a", "arguments": {"x": 1}}]', "", [call(0, "a", x=1)]),
    ("mistral", '[1] says so; [TOOL_CALLS][{"name": "a", "arguments": {}}]',
     "[1] says so;", [call(0, "a")]),
    ("json", 'I will call {"name": "lookup", "arguments": {"q": "{x}"}} then {x} ok',
     "I will call then {x} ok", [call(0, "lookup", q="{x}")]),
    ("json", 'A set {1, 2} and {"name": "n"} and { open', 'A set {1, 2} and {"name": "n"} '
     'and { open', []),
]


def streamed(parser_name, chunks, max_calls=None):
    """Feed `chunks`; the content and calls OpenAI's client would assemble, and the
    deltas' own checks: an id and a name on a call's first delta only."""
    parser = make_tool_parser(parser_name, ids(), max_calls)
    content, calls = "", {}
    for out, deltas in [parser.feed(c) for c in chunks] + [parser.finish()]:
        content += out
        for d in deltas:
            wire = d.to_openai()
            if d.index not in calls:
                assert wire["id"] and wire["type"] == "function" and "name" in wire["function"]
                calls[d.index] = [wire["id"], wire["function"]["name"], ""]
            else:
                assert "id" not in wire and "name" not in wire["function"]
            calls[d.index][2] += wire["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [ToolCall(*calls[i]) for i in sorted(calls)], parser.calls


def chunkings(text, seed=0):
    """One character at a time, every split in two, and random chunkings."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser, text, content, calls", GOLDEN)
def test_golden_outputs_parse_whole_and_streamed_alike(parser, text, content, calls):
    assert parse_tool_calls(text, parser, ids()) == (content, calls)
    for chunks in chunkings(text):
        got_content, got_calls, parser_calls = streamed(parser, chunks)
        assert (got_content, got_calls) == (content, calls), chunks
        assert parser_calls == calls


@pytest.mark.parametrize("parser, pieces, sent", [
    ("hermes", ["Hello <tool"], ["Hello"]),
    ("hermes", ["Hello <tool", "box> done"], ["Hello", " <toolbox> done"]),
    ("hermes", ["Hi ", "<tool_call>", '{"name": "f"'], ["Hi", "", ""]),
    ("mistral", ["a [TOOL_C"], ["a"]),
    ("llama3_json", [" <|python"], [""]),
    ("llama3_json", [" <|python", "!"], ["", " <|python!"]),
    ("json", ["see {\"name\": ", "\"f\"} end"], ["see", " {\"name\": \"f\"} end"]),
])
def test_a_possible_start_of_a_call_is_held_back(parser, pieces, sent):
    p = make_tool_parser(parser, ids())
    assert [p.feed(piece)[0] for piece in pieces] == sent


def test_parallel_tool_calls_false_leaves_later_calls_as_content():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, "hermes", ids(), max_calls=1)
    assert calls == [call(0, "a")]
    assert content == '\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for chunks in chunkings(text):
        assert streamed("hermes", chunks, max_calls=1)[:2] == (content, calls)


@pytest.mark.parametrize("template, name", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", "hermes"),
    ("[AVAILABLE_TOOLS] {{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("User: {{ m }}", "json"),
    (None, "json"),
])
def test_auto_chooses_the_family_from_the_chat_template(template, name):
    assert tool_parser_for("auto", template) == name
    assert tool_parser_for("mistral", template) == "mistral"


def test_unknown_parser_names_are_value_errors():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'qwen'"):
        tool_parser_for("qwen", None)
    with pytest.raises(ValueError, match="reasoning_parser"):
        output_parser(None, "", reasoning_parser="o1")


def test_partial_marker_len():
    assert partial_marker_len("abc <tool_c", ("<tool_call>",)) == 7
    assert partial_marker_len("abc <tool_call>", ("<tool_call>",)) == 0   # whole: not partial
    assert partial_marker_len("x<", ("<think>", "</think>")) == 1
    assert partial_marker_len("x</th", ("<think>", "</think>")) == 4
    assert partial_marker_len("", ("<think>",)) == 0


# ---- reasoning ----------------------------------------------------------------------

@pytest.mark.parametrize("text, inside, reasoning, content", [
    ("<think>\nThe user wants 2+2.\n</think>\n\n4", False, "\nThe user wants 2+2.\n", "4"),
    ("\n<think>a<b</think>c", False, "a<b", "c"),
    ("Just 4. <think>late</think>", False, "", "Just 4. <think>late</think>"),
    ("<think>cut off mid-tho", False, "cut off mid-tho", ""),
    ("Still thinking.\n</think>\n\nDone.", True, "Still thinking.\n", "Done."),
    ("<thin", False, "", "<thin"),
    ("", True, "", ""),
])
def test_reasoning_splits_whole_and_streamed_alike(text, inside, reasoning, content):
    assert split_reasoning(text, inside) == (reasoning, content)
    for chunks in chunkings(text) if text else [[]]:
        p = ReasoningParser(inside)
        pieces = [p.feed(c) for c in chunks] + [p.finish()]
        assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == \
            (reasoning, content), chunks


def test_reasoning_text_is_never_sent_as_content_while_a_marker_may_start():
    p = ReasoningParser()
    assert p.feed("  <thi") == ("", "")
    assert p.feed("nk>plan</th") == ("plan", "")
    assert p.feed("ink>\n") == ("", "")
    assert p.feed("answer") == ("", "answer")


QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
         "{% endfor %}<|im_start|>assistant\n{% if enable_thinking is false %}"
         "<think>\n\n</think>\n\n{% endif %}{% if tools %}<tool_call>{% endif %}")


@pytest.mark.parametrize("prompt_end", ["<|im_start|>assistant\n", "assistant\n<think>\n"])
def test_qwen3_thinking_then_tool_calls_whole_and_streamed(prompt_end):
    opened = prompt_end.endswith("<think>\n")
    text = ("" if opened else "<think>\n") + ("I need the weather.\n</think>\n\n"
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            "\n</tool_call>")
    whole = parse_output(text, output_parser(QWEN3, prompt_end, new_id=ids()))
    assert whole.reasoning == ("" if opened else "\n") + "I need the weather.\n"
    assert whole.content == "Checking."
    assert whole.calls == [call(0, "get_weather", city="Oslo")]
    for chunks in chunkings(text, seed=1):
        p = output_parser(QWEN3, prompt_end, new_id=ids())
        deltas = [p.feed(c) for c in chunks] + [p.finish()]
        assert "".join(d.reasoning for d in deltas) == whole.reasoning
        assert "".join(d.content for d in deltas) == whole.content
        assert [d.name for d in deltas for d in d.tool_calls if d.id] == ["get_weather"]
        assert p.calls == whole.calls


def test_no_tools_or_tool_choice_none_parses_no_calls():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    p = parse_output(text, output_parser(QWEN3, "", parse_tools=False))
    assert (p.content, p.calls) == (text, [])
    plain = parse_output(text, OutputParser())
    assert (plain.reasoning, plain.content, plain.calls) == ("", text, [])
