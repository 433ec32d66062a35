"""Shared fixtures for engine tests: one tiny HF model, its reference outputs."""
from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxpd import LLM
from tests.hf_fixtures import build_hf_model, hf_greedy

PAGE_SIZE = 16


class JaxEvents:
    """A listener on jax's duration events while entered (`__call__` decides)."""

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is None:          # older jax keeps it private
            from jax._src import monitoring
            unregister = monitoring._unregister_event_duration_listener_by_callback
        unregister(self)


class XlaCompiles(JaxEvents):
    """Counts XLA compiles while entered: jax records this event around every compile
    its in-memory cache misses (a persistent-cache hit included), so it counts what a
    call would have compiled. `on_request_threads`: leave out jaxpd's own compile
    threads (warm-up's and the background compiles), which serving may use."""
    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self, on_request_threads: bool = False):
        self.count, self.on_request_threads = 0, on_request_threads

    def __call__(self, event, duration, **kwargs):
        if event != self.EVENT:
            return
        if self.on_request_threads and \
                threading.current_thread().name.startswith("jaxpd-compile"):
            return
        self.count += 1


def mixed_prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Lengths that cross bucket (16/32/64) and page boundaries."""
    lengths = [1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100]
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=lengths[i % len(lengths)]).tolist() for i in range(num)]


def wait_idle(llm: LLM, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not llm.engine.is_idle():
        assert time.monotonic() < deadline, f"engine not idle: {llm.stats()}"
        time.sleep(0.01)


def assert_all_pages_free(llm: LLM) -> None:
    wait_idle(llm)
    stats = llm.stats()
    assert stats["pages_used"] == 0, stats
    assert stats["slots_active"] == 0, stats
    for alloc in llm.engine.decode_scheduler.allocators:
        assert alloc.num_free == alloc.capacity
    cache = llm.engine.prefill_cache      # the prefill mesh's: nothing held between batches
    if cache is not None:
        cache.allocator.check()
        alloc = cache.allocator
        assert alloc.num_used == 0 and alloc.num_free == alloc.capacity


def reference(hf_model, prompts, max_tokens):
    return [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]


__all__ = ["build_hf_model", "mixed_prompts", "wait_idle", "assert_all_pages_free", "reference"]
