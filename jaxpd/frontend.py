"""What every front end shares: request validation, `generate`, `stream`, events.

`LLM` (an engine in this process) and `Router` (workers in other processes) are both
front ends; they differ only in how a validated request is run (`submit`, `abort`)
and in how a dead back end shows (`failure`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

from jaxpd.chat import render_chat
from jaxpd.config import EngineConfig
from jaxpd.output_sink import EventQueue, MergedEvents
from jaxpd.outputs import CompletionOutput, RequestMetrics, StreamDelta
from jaxpd.request import Request
from jaxpd.sampling_params import SamplingParams
from jaxpd.text import TextStream, output_text
from jaxpd.validation import (MAX_REQUEST_ID_LEN, check_request, check_request_id,
                              check_text_size, default_max_prompt_bytes)
from jaxpd.models.config import ModelConfig
from jaxpd.models.tokenizer import Tokenizer


class Frontend:
    config: EngineConfig
    model_config: ModelConfig
    model_path: str
    tokenizer: Tokenizer | None
    fingerprint: str = ""       # the served model's `models.fingerprint` ("" if none yet)

    def submit(self, request: Request) -> Request:
        raise NotImplementedError

    def abort(self, request_id: str, reason: str = "cancelled") -> bool:
        raise NotImplementedError

    def new_request_id(self) -> str:
        raise NotImplementedError

    def failure(self) -> BaseException | None:
        """The error that killed the back end, if it died."""
        return None

    def stats(self) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def make_request(self, prompt: str | None = None, prompt_token_ids: Sequence[int] | None = None,
                     sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and build one request (not yet submitted). ValueError names the field.
        With `n` > 1 use `make_requests`, which builds one request per sample."""
        requests = self.make_requests(prompt, prompt_token_ids, sampling_params, request_id)
        if len(requests) != 1:
            raise ValueError(f"n={len(requests)}: one request is one sample; make_requests "
                             f"builds the {len(requests)} samples")
        return requests[0]

    def make_requests(self, prompt: str | None = None,
                      prompt_token_ids: Sequence[int] | None = None,
                      sampling_params: SamplingParams | None = None,
                      request_id: str | None = None) -> list[Request]:
        """Validate and build the `n` requests of one prompt (its samples, each with
        n=1; a seeded one's seeds are seed, seed+1, ...). ValueError names the field."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        cfg = self.config
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer.json; "
                                 "pass prompt_token_ids instead")
            check_text_size(prompt, default_max_prompt_bytes(cfg.max_prompt_len))
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt_token_ids)
        ids = check_request(ids, params, vocab_size=self.model_config.vocab_size,
                            max_prompt_len=cfg.max_prompt_len, max_model_len=cfg.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so no stop strings "
                             "(use stop_token_ids)")
        if request_id is not None:
            check_request_id(request_id)
            if params.n > 1 and len(request_id) + 3 > MAX_REQUEST_ID_LEN:
                raise ValueError(f"request_id: at most {MAX_REQUEST_ID_LEN - 3} characters "
                                 f"with n > 1 (each sample's id gets a suffix)")
        requests = []
        for i in range(params.n):
            one = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**63)
            rid = request_id or self.new_request_id()
            if request_id is not None and params.n > 1:
                rid = f"{request_id}-{i}"
            requests.append(Request(rid, ids, one, self.model_config.eos_token_ids))
        return requests

    # ---- generation ---------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[CompletionOutput]:
        """Generate for every prompt (all submitted at once). Outputs in prompt order;
        a prompt whose params have `n` > 1 gives its n samples in a row (`index` 0..n-1)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts and prompt_token_ids")
        items = list(prompts) if prompts is not None else list(prompt_token_ids)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for "
                                 f"{len(items)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(items)
        samples = []    # (request, its index among its prompt's samples)
        for x, p in zip(items, params):
            made = (self.make_requests(prompt=x, sampling_params=p) if prompts is not None
                    else self.make_requests(prompt_token_ids=x, sampling_params=p))
            samples += [(r, i) for i, r in enumerate(made)]
        submitted = []
        try:
            for r, _ in samples:
                submitted.append(self.submit(r))
            return [self._wait(r, i) for r, i in samples]
        finally:
            for r in submitted:
                if not r.is_final:
                    self.abort(r.request_id, "caller gave up")

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
             ) -> list[CompletionOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} dicts) or
        to each of a batch of them, through the model's chat template with the
        generation prompt added (`jaxpd.chat`); outputs in conversation order.
        ValueError for a model without a template, a bad role or non-string content."""
        batch = (isinstance(messages, (list, tuple)) and bool(messages)
                 and all(isinstance(m, (list, tuple)) for m in messages))
        conversations = list(messages) if batch else [messages]
        return self.generate([self.chat_prompt(c) for c in conversations], sampling_params)

    def chat_prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text the model's chat template makes of one conversation, with
        the function `tools` the model may call and more template variables
        (`jaxpd.chat.render_chat`)."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer.json, so no chat template")
        tok = self.tokenizer
        eos_ids = self.model_config.eos_token_ids
        return render_chat(tok.chat_template, messages,
                           bos_token=tok.id_to_token(tok.bos_token_id) or "",
                           eos_token=(tok.id_to_token(eos_ids[0]) if eos_ids else None) or "",
                           tools=tools, template_kwargs=template_kwargs)

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
               prompt_token_ids: Sequence[int] | None = None) -> Iterator[StreamDelta]:
        """Yield `StreamDelta`s as tokens are produced; the last one has finish_reason.
        One sample: `n` > 1 is a ValueError (`generate` returns n samples)."""
        r = self.submit(self.make_request(prompt, prompt_token_ids, sampling_params))
        try:
            yield from self.deltas(r)
        finally:
            if not r.is_final:
                self.abort(r.request_id, "stream closed")

    def deltas(self, request: Request) -> Iterator[StreamDelta]:
        """`events(request)` as `StreamDelta`s (`delta_maker`)."""
        make = self.delta_maker(request)
        for ids, finish in self.events(request):
            yield make(ids, finish)

    def delta_maker(self, request: Request) -> Callable[[list[int], str | None], StreamDelta]:
        """A function from one event of `request` to its `StreamDelta`: the text of the
        new tokens (stop strings applied: text that may begin one is held back until it
        is known not to) and their log-probabilities when the request asked for them.
        Events go through it in order, once each."""
        text = TextStream(self.tokenizer, request.params.stop) if self.tokenizer else None
        seen = 0

        def make(ids: list[int], finish: str | None) -> StreamDelta:
            nonlocal seen
            new = text.push(ids) if text else ""
            if finish is not None and text:
                new += text.finish()
            logprobs = None
            if request.logprobs is not None:
                logprobs, seen = request.logprobs[seen:seen + len(ids)], seen + len(ids)
            return StreamDelta(request.request_id, ids, new, finish, logprobs)
        return make

    @staticmethod
    def merge_events(requests: Sequence[Request], max_buffered: int | None = None
                     ) -> MergedEvents | None:
        """Give several not yet submitted requests one blocking queue for their events
        (`merged_deltas` then waits on it with one thread); None for a single request."""
        if len(requests) == 1:
            if max_buffered is not None:
                requests[0].events = EventQueue(max_buffered)
            return None
        merged = MergedEvents(len(requests), max_buffered)
        for r, sink in zip(requests, merged.sinks):
            r.events = sink
        return merged

    def merged_deltas(self, requests: Sequence[Request], merged: MergedEvents | None = None
                      ) -> Iterator[tuple[int, StreamDelta]]:
        """(index in `requests`, delta) of several requests as they come, read by the
        calling thread alone from `merged` (what `merge_events` gave them before they
        were submitted; one request needs none); ends when all have ended."""
        if len(requests) == 1:
            for d in self.deltas(requests[0]):
                yield 0, d
            return
        if merged is None:
            raise ValueError("several requests stream together only through the "
                             "MergedEvents that merge_events gave them before submit")
        makers = [self.delta_maker(r) for r in requests]
        live = len(requests)
        while live:
            i, (ids, finish) = merged.get()
            yield i, makers[i](ids, finish)
            live -= finish is not None

    def events(self, request: Request) -> Iterator[tuple[list[int], str | None]]:
        """(new token ids, finish reason or None) until the request ends, from its
        `EventQueue` (the default sink). Never hangs on a dead back end: one that fails
        aborts every live request, and `submit` refuses once it has failed."""
        while True:
            ids, finish = request.events.get()
            yield ids, finish
            if finish is not None:
                return

    def completion(self, r: Request, index: int = 0) -> CompletionOutput:
        """The output of a final request (its text cut before the first stop string)."""
        text = output_text(self.tokenizer, r.output_ids, r.params.stop) if self.tokenizer else None
        return CompletionOutput(r.request_id, list(r.prompt_ids), list(r.output_ids), text,
                                r.finish_reason or "abort", r.abort_reason, RequestMetrics.of(r),
                                None if r.logprobs is None else list(r.logprobs), index)

    def _wait(self, r: Request, index: int = 0) -> CompletionOutput:
        for _ in self.events(r):
            pass
        return self.completion(r, index)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
