"""Chat messages -> a prompt string, through the model's own Jinja chat template.

Rendered as transformers' `apply_chat_template` renders it: a sandboxed, immutable
Jinja environment (a template is code that came with a checkpoint: it may not reach
Python internals such as `''.__class__.__mro__`, nor mutate what it is given), with
`trim_blocks` and `lstrip_blocks`, the `raise_exception(message)` function and a
`tojson` filter that keeps non-ASCII characters, and `bos_token` / `eos_token` /
`add_generation_prompt` in its context. Plain Python: no jax.
"""
from __future__ import annotations

import functools
import json
from typing import Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 4096


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or could not render."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own `tojson` escapes HTML characters, which changes the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None


def check_messages(messages) -> list[dict]:
    """The messages as plain dicts, or ValueError naming what is wrong: a non-empty list
    of {"role": one of ROLES, "content": str} (other keys, e.g. "name", pass through).
    An assistant message with `tool_calls` may have no content; its calls' arguments,
    JSON text in OpenAI's API, become objects (templates write them with `tojson`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(messages)} entries, more than {MAX_MESSAGES}")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        m = dict(m)
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only assistant messages make calls")
            m["tool_calls"] = [_check_call(f"messages[{i}].tool_calls[{j}]", c)
                               for j, c in enumerate(_as_list(m["tool_calls"], i))]
            if content is None:
                checked.append(m)
                continue
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, "
                             f"got {type(content).__name__}")
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise ValueError(f"messages[{i}].tool_call_id must be a string")
        checked.append(m)
    return checked


def _as_list(calls, i: int) -> list:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    return list(calls)


def _check_call(where: str, call) -> dict:
    """One of an assistant's calls in OpenAI's shape, its arguments as an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': "
                         f"{{'name', 'arguments'}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ValueError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return {**call, "function": {**function, "arguments": dict(arguments)}}


def render_chat(template: str | None, messages, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True, tools: Sequence[dict] | None = None,
                template_kwargs: Mapping | None = None) -> str:
    """The prompt `template` makes of `messages` (checked by `check_messages`).
    `tools`: the function tools the model may call, in OpenAI's shape, as the template's
    `tools` variable (unset without them, as transformers leaves it);
    `template_kwargs`: more variables for the template (e.g. Qwen3's `enable_thinking`),
    none of the names above. ValueError when there is no template, for bad messages or
    kwargs, or when the template refuses or fails (a sandbox violation included)."""
    if not template:
        raise ValueError("this model has no chat template (no chat_template in its "
                         "tokenizer_config.json nor a chat_template.jinja); use a prompt")
    messages = check_messages(messages)
    context = dict(template_kwargs or {})
    taken = sorted(context.keys() & _RESERVED)
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here")
    context.update(messages=messages, bos_token=bos_token, eos_token=eos_token,
                   add_generation_prompt=add_generation_prompt)
    if tools:
        context["tools"] = [dict(t) for t in tools]
    try:
        return _compile(template).render(**context)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None


_RESERVED = {"messages", "tools", "bos_token", "eos_token", "add_generation_prompt",
             "raise_exception"}
