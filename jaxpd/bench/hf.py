"""The Hugging Face transformers baseline: the same requests through `generate`.

Static batching, the best plain `generate` allows: whenever the model is free, every
request that has arrived (up to `max_batch`, oldest first) is taken as one batch,
prompts left-padded to the longest with an attention mask, and generated greedily
for as many steps as the batch's longest output (`min_new_tokens` = `max_new_tokens`,
no EOS: the same work as the engine's `ignore_eos`). Requests that arrive meanwhile
wait for the whole batch to finish -- the head-of-line blocking continuous batching
removes. Token times come from a `StoppingCriteria` that `generate` calls once after
every step (the first call follows the prefill): request i's k-th token is stamped
with the time of step k, and its finish is its own last token, not the batch's.

PyTorch on CPU, float32 weights loaded with `AutoModelForCausalLM.from_pretrained`.
"""
from __future__ import annotations

import collections
import os
import time
from typing import Callable, Sequence

from jaxpd.bench.driver import BenchRequest, RunResult, run_duration, sleep_until
from jaxpd.metrics import RequestTimeline


class HFBackend:
    """transformers `generate` with arrival-driven static batches."""

    name = "hf"

    def __init__(self, model_dir: str, max_batch: int = 8,
                 warmup_requests: Sequence[BenchRequest] = ()):
        import torch
        from transformers import AutoModelForCausalLM

        if max_batch < 1:
            raise ValueError(f"hf max_batch must be >= 1, got {max_batch}")
        self._torch = torch
        self.max_batch = max_batch
        # Same placement and dtype policy as jaxpd's dtype="auto": float32 on CPU,
        # bfloat16 on an accelerator.
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        from jaxpd.models.source import checkpoint_path, is_gguf
        path = checkpoint_path(model_dir)
        if is_gguf(path):      # transformers dequantizes a GGUF file to `dtype`
            self.model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.model.to(self.device)
        # A generation_config.json may carry sampling defaults; greedy is asked explicitly,
        # so drop them rather than have transformers warn on every call.
        gen = self.model.generation_config
        gen.temperature, gen.top_p, gen.top_k = None, None, None
        gen.max_length = None   # max_new_tokens is given per batch
        if warmup_requests:   # first calls allocate and pick kernels: keep them unmeasured
            self._generate(list(warmup_requests)[:max_batch])

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        timelines: dict[int, RequestTimeline] = {}
        num_batches = 0
        origin = time.perf_counter()
        while pending:
            sleep_until(origin + pending[0].arrival_s)
            now = time.perf_counter() - origin
            batch = []
            while pending and pending[0].arrival_s <= now and len(batch) < self.max_batch:
                batch.append(pending.popleft())
            step_times = [t - origin for t in self._generate(batch)]
            num_batches += 1
            for r in batch:
                tokens = step_times[:r.output_len]
                timelines[r.index] = RequestTimeline(r.arrival_s, tokens, tokens[-1])
                if on_done is not None:
                    on_done()
        ordered = [timelines[r.index] for r in requests]
        return RunResult(ordered, run_duration(ordered), 0,
                         {"batches": num_batches, "max_batch": self.max_batch})

    def _generate(self, batch: Sequence[BenchRequest]) -> list[float]:
        """Greedy-generate for `batch` as one left-padded batch; the perf_counter
        time of every step."""
        torch = self._torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        class StepClock(StoppingCriteria):
            """Never stops; stamps each step (called once per generated token)."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                if input_ids.is_cuda:   # the step's time is when its token exists
                    torch.cuda.synchronize()
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_ids)
            mask[i, width - n:] = 1
        steps = max(r.output_len for r in batch)
        clock = StepClock()
        with torch.no_grad():
            self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False, max_new_tokens=steps,
                                min_new_tokens=steps, eos_token_id=None, pad_token_id=0,
                                stopping_criteria=StoppingCriteriaList([clock]))
        if len(clock.times) < steps:
            raise RuntimeError(f"transformers generate ran {len(clock.times)} steps, "
                               f"expected {steps}")
        return clock.times[:steps]

    def close(self) -> None:
        self.model = None
