"""OpenAI's API as data: the request bodies (pydantic, unknown fields refused), which
fields ask for what jaxpd cannot do yet, the error shape, usage and SSE framing.
No jax and no server: `jaxpd.serving.http` serves it."""
from __future__ import annotations

import json
import re
import time
from typing import Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from jaxpd.request import Request
from jaxpd.sampling_params import SamplingParams

RETRY_AFTER_S = "1"


# ---- the request bodies -------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


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


class ChatBody(Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def unsupported(body: Body) -> str | None:
    """The first field asking for an option jaxpd does not have yet, or None."""
    asks = [
        ("n", body.n not in (None, 1)),
        ("stop", bool(body.stop)),
        ("presence_penalty", body.presence_penalty not in (None, 0)),
        ("frequency_penalty", body.frequency_penalty not in (None, 0)),
        ("repetition_penalty", body.repetition_penalty not in (None, 1)),
        ("min_p", body.min_p not in (None, 0)),
        ("logit_bias", bool(body.logit_bias)),
    ]
    if isinstance(body, CompletionBody):
        asks += [("logprobs", body.logprobs is not None), ("echo", body.echo),
                 ("best_of", body.best_of not in (None, 1)), ("suffix", bool(body.suffix))]
    else:
        asks += [("logprobs", bool(body.logprobs)),
                 ("top_logprobs", body.top_logprobs not in (None, 0))]
    return next((field for field, asked in asks if asked), None)


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


def usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.output_ids),
            "total_tokens": len(r.prompt_ids) + len(r.output_ids)}


def sse(payload) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def sampling_params(body: CompletionBody | ChatBody, num_prompt_tokens: int,
                    max_model_len: int) -> SamplingParams:
    """The body's options as `SamplingParams` (ValueError names the field)."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:   # OpenAI's defaults: 16 (completions), the rest of the context (chat)
        room = max_model_len - num_prompt_tokens
        max_tokens = max(1, room) if isinstance(body, ChatBody) else min(16, max(1, room))
    top_k = body.top_k if body.top_k not in (None, -1) else 0   # vLLM: -1 is off
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k, top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)


def whole_response(r: Request, text: str, body: Body, model_id: str) -> dict:
    """The non-streamed answer to a finished request."""
    chat = isinstance(body, ChatBody)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": r.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason}
    if body.return_token_ids:
        choice.update(prompt_token_ids=list(r.prompt_ids), token_ids=list(r.output_ids))
    return {"id": ("chatcmpl-" if chat else "cmpl-") + r.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice],
            "usage": usage(r)}
