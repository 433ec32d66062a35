"""The llama.cpp baselines: the same requests through `llama-cpp-python` on the same
GGUF file, greedy, EOS ignored (the engine's `ignore_eos`: the same work), each token
stamped when llama.cpp returns it (TTFT includes the prompt's evaluation).

- `--compare llama_cpp`: one sequence at a time, the way a llama.cpp `Llama` object
  serves: requests in arrival order, each started when it has arrived and the one
  before it has finished.
- `--compare llama_cpp_batched`: as llama.cpp's server batches, through the low-level
  API: up to `n_seq` sequences at once, each step one `llama_decode` of one
  `llama_batch` holding every running sequence's next token and the prompt tokens of
  those just admitted, each sequence in a KV stream of its own.

Threads: `n_threads` (default: the CPUs this process may run on). The optional extra
`llama-cpp` installs it, built from source; the README gives the build flags (AVX-512
named explicitly where the host has it: `GGML_NATIVE` crashed in these VMs). What the
build runs is recorded (`build_info`), and a build without AVX-512 on a host with it
is said in one line: it would be a weaker baseline than llama.cpp can be.
"""
from __future__ import annotations

import collections
import ctypes
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from jaxpd.bench.driver import BenchRequest, RunResult, run_duration, sleep_until
from jaxpd.metrics import RequestTimeline

NAME = "llama_cpp"
BATCHED = "llama_cpp_batched"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_file(baseline: str, model: str) -> str:
    """The GGUF file of `model` for `--compare baseline`; SystemExit saying what is
    missing when llama-cpp-python is not installed or the model is no GGUF file."""
    if not available():
        raise SystemExit(f"--compare {baseline} needs llama-cpp-python: pip install "
                         "'jaxpd[llama-cpp]' (see the README for building it)")
    from jaxpd.models.source import checkpoint_path, is_gguf

    path = checkpoint_path(model)
    if not is_gguf(path):
        raise SystemExit(f"--compare {baseline} serves GGUF files only; --model is {path}")
    return path


def build_info() -> dict:
    """What the installed llama.cpp build runs on this host: its system-info line and
    whether it uses AVX-512, beside whether the host has it."""
    import llama_cpp
    from jaxpd.bench.host import describe_host, has_avx512

    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    host = describe_host()
    built = "AVX512 = 1" in info or "AVX512 : 1" in info or "AVX512=1" in info.replace(" ", "")
    if has_avx512(host) and not built:
        print("llama.cpp: this build does not use AVX-512, which the host has: a weaker "
              "baseline (rebuild it with the README's CMAKE_ARGS)", file=sys.stderr)
    return {"system_info": info, "avx512": built, "host_avx512": has_avx512(host)}


class LlamaCppBackend:
    """llama.cpp serving one request at a time from a GGUF file."""

    name = NAME

    def __init__(self, gguf_path: str, n_ctx: int = 2048, n_threads: int | None = None,
                 warmup_requests: Sequence[BenchRequest] = ()):
        path = gguf_file(NAME, gguf_path)
        import llama_cpp
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        self.model = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=self.n_threads,
                                     n_threads_batch=self.n_threads, verbose=False)
        for r in list(warmup_requests)[:2]:
            self._generate(r)

    def _generate(self, r: BenchRequest) -> list[float]:
        """Token times (perf_counter) of one request, greedy, `output_len` tokens."""
        self.model.reset()
        times: list[float] = []
        for _ in self.model.generate(list(r.prompt_ids), temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) >= r.output_len:
                break
        return times

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        timelines: dict[int, RequestTimeline] = {}
        origin = time.perf_counter()
        while pending:
            r = pending.popleft()
            sleep_until(origin + r.arrival_s)
            tokens = [t - origin for t in self._generate(r)]
            timelines[r.index] = RequestTimeline(r.arrival_s, tokens, tokens[-1])
            if on_done is not None:
                on_done()
        ordered = [timelines[r.index] for r in requests]
        return RunResult(ordered, run_duration(ordered), 0,
                         {"n_threads": self.n_threads, **build_info()})

    def close(self) -> None:
        close = getattr(self.model, "close", None)     # llama-cpp-python >= 0.2.80
        if close is not None:
            close()
        self.model = None


class LlamaCppBatchedBackend:
    """llama.cpp serving up to `n_seq` requests at once from a GGUF file, batched as its
    server batches (module docstring). A step holds every running sequence's next token
    first, then prompt tokens of admitted requests up to `n_batch` in all (a longer
    prompt continues in the next step); a request is admitted, in arrival order, once
    it has arrived and a sequence is free. Greedy: the argmax of each sequence's logits."""

    name = BATCHED

    def __init__(self, gguf_path: str, n_seq: int, n_ctx: int = 2048,
                 n_threads: int | None = None, n_batch: int = 2048,
                 warmup_requests: Sequence[BenchRequest] = ()):
        path = gguf_file(BATCHED, gguf_path)
        import llama_cpp as lc
        self.lc, self.n_seq, self.n_batch = lc, n_seq, n_batch
        self.n_threads = n_threads or len(os.sched_getaffinity(0))
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq            # each sequence's stream holds n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.kv_unified = False               # distinct prompts: a stream each
        params.n_threads = params.n_threads_batch = self.n_threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of {n_seq} sequences")
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        if warmup_requests:
            self.run(list(warmup_requests)[:n_seq])

    def _step(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One `llama_decode` of (token, position, sequence, wants logits) entries;
        the argmax token of each entry that wants logits, in order."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(logits)
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, (_, _, _, logits) in enumerate(entries):
            if logits:
                row = self.lc.llama_get_logits_ith(self.ctx, i)
                values = np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                               shape=(self.vocab,))
                out.append(int(values.argmax()))
        return out

    def run(self, requests: Sequence[BenchRequest],
            on_done: Callable[[], None] | None = None) -> RunResult:
        pending = collections.deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        free = list(range(self.n_seq))
        # sequence -> [request, prompt tokens fed, tokens out (last is the next input)]
        running: dict[int, list] = {}
        times: dict[int, list[float]] = {r.index: [] for r in requests}
        timelines: dict[int, RequestTimeline] = {}
        origin = time.perf_counter()
        while pending or running:
            now = time.perf_counter() - origin
            while pending and free and pending[0].arrival_s <= now:
                running[free.pop(0)] = [pending.popleft(), 0, []]
            if not running:
                sleep_until(origin + pending[0].arrival_s)
                continue
            entries, owners = [], []
            for seq, (r, fed, out) in running.items():
                if fed == len(r.prompt_ids):                      # decoding
                    entries.append((out[-1], fed + len(out) - 1, seq, True))
                    owners.append(seq)
            for seq, state in running.items():
                r, fed, _ = state
                room = self.n_batch - len(entries)
                if fed == len(r.prompt_ids) or room <= 0:
                    continue
                take = min(room, len(r.prompt_ids) - fed)
                for j in range(fed, fed + take):
                    last = j == len(r.prompt_ids) - 1
                    entries.append((r.prompt_ids[j], j, seq, last))
                    if last:
                        owners.append(seq)
                state[1] = fed + take
            tokens = self._step(entries)
            stamp = time.perf_counter() - origin
            for seq, token in zip(owners, tokens):
                r, _, out = running[seq]
                out.append(token)
                times[r.index].append(stamp)
                if len(out) >= r.output_len:
                    self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
                    t = times[r.index]
                    timelines[r.index] = RequestTimeline(r.arrival_s, t, t[-1])
                    if on_done is not None:
                        on_done()
        ordered = [timelines[r.index] for r in requests]
        return RunResult(ordered, run_duration(ordered), 0,
                         {"n_threads": self.n_threads, "n_seq": self.n_seq, **build_info()})

    def close(self) -> None:
        if self.ctx is None:
            return
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
        self.ctx = self.model = None
