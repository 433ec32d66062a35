"""Latency profiles for the planner: the engine's own runners, timed on real meshes.

`MeshProfiler` loads a model once and, for a mesh shape, builds the same jitted
programs the engine runs (`PrefillRunner` on a `tp` mesh, `DecodeRunner` on a
`dp x tp` mesh, weights placed by the same logical rules) and times them:
- prefill: one call per (batch, padded length), the best of `repeats`; a sample is
  (the batch's prompt lengths, seconds), ready for `simulator.fit_prefill`;
- decode: one step with `b` active slots at context `c` (spread over the dp shards
  as the scheduler spreads them), the others idle on the null page; the step runs
  every slot whatever `b` is, as the engine's does. A sample is ([c] * b, seconds),
  ready for `simulator.fit_decode`;
- transfer: `jax.device_put` of one prompt's K and V pages from the first device to
  the last, seconds per prompt token.
Each mesh is timed alone: on virtual CPU devices sharing cores, the interference of a
prefill and a decode running at once is not in these numbers.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from jaxpd.config import EngineConfig
from jaxpd.engine.scheduling.buckets import context_width

Sample = tuple[list[int], float]


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()   # compile and first-touch, unmeasured
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class MeshProfiler:
    """Times the engine's prefill and decode programs on meshes of given shapes."""

    def __init__(self, model_dir: str, page_size: int = 16, repeats: int = 3):
        from jaxpd.engine.programs.decode_runner import CompileCounter
        from jaxpd.models import checkpoint

        loaded = checkpoint.load(model_dir, dtype="float32")
        self.cfg, self.params = loaded.cfg, loaded.params
        self.page_size, self.repeats = page_size, repeats
        self.counter = CompileCounter()

    def _place(self, mesh, fuse: bool):
        """(params, rules, fused) on `mesh`, laid out as the engine places them, and the
        attention kernels the engine's default serves with on its devices."""
        import jax.numpy as jnp
        from jaxpd.config import resolve_attention_impl
        from jaxpd.engine.programs.placement import place_params
        attention = resolve_attention_impl("auto", mesh.devices.flat[0].platform)
        return (*place_params(self.cfg, self.params, mesh, jnp.float32, fuse=fuse), attention)

    @staticmethod
    def _devices(n: int) -> list:
        import jax
        devices = jax.devices()
        if n > len(devices):
            raise ValueError(f"profiling a {n}-device mesh needs {n} devices, {len(devices)} "
                             f"exist (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count)")
        return devices[:n]

    def prefill(self, tp: int, lengths: Sequence[int], batches: Sequence[int],
                max_tokens: int | None = None) -> list[Sample]:
        """Samples of prefill batches on a `tp`-device mesh (every batch x length,
        skipping those over `max_tokens` padded tokens, as the scheduler would)."""
        from jax.sharding import Mesh
        from jaxpd.engine.programs.prefill_runner import PrefillRunner
        from jaxpd.engine.programs.sampler import SamplingArrays

        mesh = Mesh(np.array(self._devices(tp)), ("tp",))
        params, rules, fused, attention = self._place(mesh, fuse=False)
        runner = PrefillRunner(self.cfg, params, mesh, rules, self.page_size, self.counter,
                               fused=fused, attention_impl=attention)
        samples = []
        for length in lengths:
            for batch in batches:
                if max_tokens is not None and batch * length > max_tokens and batch > 1:
                    continue
                tokens = np.full((batch, length), 3, np.int32)
                lens = np.full(batch, length, np.int32)
                sampling = SamplingArrays.empty(batch)
                # `run` reads the first tokens back to numpy: the call is complete.
                seconds = _best(lambda: runner.run(tokens, lens, sampling), self.repeats)
                samples.append(([length] * batch, seconds))
        return samples

    def decode(self, dp: int, tp: int, slots_per_shard: int, contexts: Sequence[int],
               batches: Sequence[int]) -> list[Sample]:
        """Samples of decode steps on a `dp x tp` mesh with `dp * slots_per_shard` slots."""
        from jax.sharding import Mesh
        from jaxpd.engine.programs.decode_runner import DecodeRunner
        from jaxpd.engine.programs.sampler import SamplingArrays

        mesh = Mesh(np.array(self._devices(dp * tp)).reshape(dp, tp), ("dp", "tp"))
        params, rules, fused, attention = self._place(mesh, fuse=True)
        num_slots = dp * slots_per_shard
        pages_per_slot = -(-(max(contexts) + 1) // self.page_size)
        runner = DecodeRunner(self.cfg, params, mesh, rules, num_slots,
                              slots_per_shard * pages_per_slot + 1, self.page_size, self.counter,
                              fused=fused, attention_impl=attention)
        samples = []
        for context in contexts:
            num_pages = -(-(context + 1) // self.page_size)
            width = context_width(num_pages, EngineConfig.decode_context_step, pages_per_slot,
                                  attention != "reference")
            for batch in sorted({min(b, num_slots) for b in batches}):
                positions = np.zeros(num_slots, np.int32)
                tables = np.zeros((num_slots, width), np.int32)
                for i in range(batch):
                    # Round-robin over shards, as DecodeScheduler.find_slot balances them.
                    shard, local = i % dp, i // dp
                    slot = shard * slots_per_shard + local
                    positions[slot] = context
                    tables[slot, :num_pages] = 1 + local * pages_per_slot + np.arange(num_pages)
                override = np.zeros(num_slots, np.int32)
                use_override = np.ones(num_slots, bool)
                sampling = SamplingArrays.empty(num_slots)
                seconds = _best(lambda: np.asarray(runner.step(
                    override, use_override, positions, tables, sampling)[0]), self.repeats)
                samples.append(([context] * batch, seconds))
        return samples

    def transfer_s_per_token(self, num_tokens: int) -> float:
        """Seconds per prompt token to move a prompt's K and V pages across devices."""
        import jax
        import jax.numpy as jnp
        cfg = self.cfg
        devices = jax.devices()
        num_pages = -(-num_tokens // self.page_size)
        shape = (cfg.num_layers, num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        kv = jax.device_put((jnp.zeros(shape), jnp.ones(shape)), devices[0])
        seconds = _best(lambda: jax.block_until_ready(jax.device_put(kv, devices[-1])),
                        self.repeats)
        return seconds / (num_pages * self.page_size)
