"""OpenAI's API as data: the request bodies (pydantic, unknown fields refused), which
fields ask for what jaxpd cannot do yet, the error shape, usage and SSE framing.
No jax and no server: `jaxpd.serving.http` serves it."""
from __future__ import annotations

import json
import math
import re
import time
from typing import Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxpd.parsing import OutputDelta, OutputParser
from jaxpd.request import Request
from jaxpd.sampling_params import SamplingParams

RETRY_AFTER_S = "1"


# ---- the request bodies -------------------------------------------------------------

class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the usage (OpenAI). `continuous_usage_stats`
    (vLLM's extension, which benchmark clients send): with `include_usage`, every chunk
    carries the usage so far (the tokens streamed until then)."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Body(BaseModel):
    """Fields every generation request shares; an unknown field is a 400."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None   # labels the caller; accepted and not used
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False


class CompletionBody(Body):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None      # a JSON Schema object
    strict: bool | None = None


class Tool(BaseModel):
    """A function the model may call (OpenAI's `tools` entry)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolFunction


class ChatBody(Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra body fields: variables for the chat template, and (jaxpd's) the
    # tool-call parser for this request instead of the server's
    chat_template_kwargs: dict | None = None
    tool_call_parser: str | None = None


def unsupported(body: Body) -> str | None:
    """The first field asking for an option jaxpd does not have, or None."""
    asks = [("logit_bias", bool(body.logit_bias))]
    if isinstance(body, CompletionBody):
        asks += [("echo", body.echo), ("best_of", body.best_of not in (None, 1, body.n)),
                 ("suffix", bool(body.suffix))]
    return next((field for field, asked in asks if asked), None)


def tool_options(body: ChatBody) -> tuple[list[dict] | None, bool]:
    """(the tools for the chat template, whether to parse calls in the output) of a
    chat body; ApiError naming `tools` or `tool_choice` for what is wrong, or asks for
    what needs constrained decoding (`required`, a named function): not supported yet."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    names = [t["function"]["name"] for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad(f"tools: the function {twice[0]!r} is defined twice", "tools")
    choice = body.tool_choice
    needs_grammar = "needs constrained decoding, which jaxpd does not support yet"
    strict = next((i for i, t in enumerate(tools) if t["function"].get("strict")), None)
    if strict is not None:
        raise bad(f"tools.{strict}.function.strict: arguments that follow the schema "
                  f"exactly {needs_grammar}", f"tools.{strict}.function.strict",
                  "unsupported_parameter")
    needs_grammar += "; use 'auto' (the model chooses) or 'none'"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad("tool_choice: a named choice is {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")
        if name not in names:
            raise bad(f"tool_choice: names the function {name!r}, which is not in tools",
                      "tool_choice")
        raise bad(f"tool_choice: a named function {needs_grammar}", "tool_choice",
                  "unsupported_parameter")
    if choice == "required":
        raise bad(f"tool_choice: 'required' {needs_grammar}", "tool_choice",
                  "unsupported_parameter")
    if choice not in (None, "auto", "none"):
        raise bad(f"tool_choice: must be 'auto', 'none', 'required' or a named function, "
                  f"got {choice!r}", "tool_choice")
    return tools or None, bool(tools) and choice != "none"


# ---- errors -------------------------------------------------------------------------

class ApiError(Exception):
    """Answer with this status and OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="service_unavailable")


def busy(message: str) -> ApiError:
    return ApiError(429, message, type="rate_limit_exceeded", code="rate_limit_exceeded",
                    headers={"Retry-After": RETRY_AFTER_S})


def validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return bad(f"{param}: unknown or unsupported field", param, "unsupported_parameter")
    return bad(f"{param}: {err['msg']}", param)


def value_error(e: ValueError, fields: tuple[str, ...], rename: dict[str, str]) -> ApiError:
    """Our ValueErrors begin with the field they are about: that is `param`."""
    message = str(e)
    first = re.match(r"[A-Za-z_]*", message).group()
    param = rename.get(first, first) if first in fields else None
    return bad(message, param)


def flatten_content(message: dict) -> dict:
    """OpenAI's list-of-parts content as one string (text parts only)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise bad("messages: only text content parts are supported", "messages",
                       "unsupported_parameter")
        message = dict(message, content="".join(p["text"] for p in content))
    return message


def sse(payload) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def sampling_params(body: CompletionBody | ChatBody, num_prompt_tokens: int,
                    max_model_len: int) -> SamplingParams:
    """The body's options as `SamplingParams` (ValueError names the field)."""
    max_tokens = body.max_tokens
    chat = isinstance(body, ChatBody)
    if chat and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:   # OpenAI's defaults: 16 (completions), the rest of the context (chat)
        room = max_model_len - num_prompt_tokens
        max_tokens = max(1, room) if chat else min(16, max(1, room))
    top_k = body.top_k if body.top_k not in (None, -1) else 0   # vLLM: -1 is off
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    optional = {name: getattr(body, name) for name in (
        "temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "min_p", "n") if getattr(body, name) is not None}
    return SamplingParams(
        max_tokens=max_tokens, top_k=top_k, seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        stop=body.stop or (), logprobs=logprobs, **optional)


def _finite(x: float) -> float:
    """JSON has no NaN or infinities: OpenAI writes -9999.0 for an impossible token."""
    return x if math.isfinite(x) else -9999.0


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id]) or tokenizer.id_to_token(token_id) or ""


def completion_logprobs(tokenizer, ids: list[int], entries: list, offset: int) -> dict:
    """The legacy completions shape of `entries` (one `TokenLogprobs` per id);
    `offset`: where the first token's text begins in the choice's text."""
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp, _ in entries],
            "top_logprobs": [{token_text(tokenizer, t): _finite(v) for t, v in top}
                             for _, top in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, ids: list[int], entries: list) -> dict:
    """The chat completions shape of `entries` (one `TokenLogprobs` per id)."""
    def one(t: int, v: float) -> dict:
        text = token_text(tokenizer, t)
        return {"token": text, "logprob": _finite(v), "bytes": list(text.encode())}
    return {"content": [{**one(t, lp), "top_logprobs": [one(u, v) for u, v in top]}
                        for t, (lp, top) in zip(ids, entries)]}


def choice(index: int, text: str, finish: str | None, ids: list[int], logprobs,
           body: Body, tokenizer, offset: int = 0, stream: bool = False,
           role: bool = False, parsed: OutputDelta | OutputParser | None = None) -> dict:
    """One entry of `choices` (a whole answer's, or a stream chunk's). `parsed`: the
    chat output split into reasoning, content and tool calls (a stream chunk's
    `OutputDelta`, or a whole answer's `OutputParser`); None: `text` is the content."""
    out: dict = {"index": index}
    if isinstance(body, ChatBody):
        if stream:
            out["delta"] = ({} if text is None else {"content": text}) if parsed is None \
                else _delta(parsed)
            if role:
                out["delta"]["role"] = "assistant"
        else:
            out["message"] = {"role": "assistant", "content": text}
            if parsed is not None:
                out["message"] = _message(parsed)
                if parsed.calls:
                    finish = "tool_calls"
        out["logprobs"] = None if logprobs is None else chat_logprobs(tokenizer, ids, logprobs)
    else:
        out["text"] = text or ""
        out["logprobs"] = (None if logprobs is None
                           else completion_logprobs(tokenizer, ids, logprobs, offset))
    out["finish_reason"] = finish
    if body.return_token_ids:
        out["token_ids"] = ids
    return out


def _delta(parsed: OutputDelta) -> dict:
    delta: dict = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = [d.to_openai() for d in parsed.tool_calls]
    return delta


def _message(parsed: OutputParser) -> dict:
    """With tool calls and nothing else said, `content` is null (as OpenAI answers)."""
    message = {"role": "assistant",
               "content": parsed.content if parsed.content or not parsed.calls else None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.calls]
    return message


def whole_response(outputs: list, body: Body, model_id: str, tokenizer,
                   parsers: list[OutputParser] | None = None) -> dict:
    """The non-streamed answer: `outputs` are the `CompletionOutput`s, in choice order;
    `parsers`: each chat output's, having read its whole text (None: text as content)."""
    chat = isinstance(body, ChatBody)
    choices = []
    for i, out in enumerate(outputs):
        c = choice(i, out.text or "", out.finish_reason, out.token_ids, out.logprobs, body,
                   tokenizer, parsed=parsers[i] if parsers else None)
        if body.return_token_ids:
            c["prompt_token_ids"] = out.prompt_token_ids
        choices.append(c)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in _first_samples(outputs, body))
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    return {"id": ("chatcmpl-" if chat else "cmpl-") + outputs[0].request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def usage(requests: list[Request], body: Body, completion: int | None = None) -> dict:
    """Usage of a request's samples (each prompt counted once, as OpenAI does);
    `completion`: the output tokens to count (None: every one generated)."""
    prompt = sum(len(r.prompt_ids) for r in _first_samples(requests, body))
    if completion is None:
        completion = sum(len(r.output_ids) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _first_samples(items: list, body: Body) -> list:
    return items[::body.n or 1]
