"""`PrefillRunner`: the prefill mesh's (tp) jitted programs. One program per (batch,
length) bucket returns the first sampled token of each row (penalised by its prompt, with
its log-probabilities) and the prompt KV; `take` cuts a request's used pages out of the
bucket for the connector. `run_layerwise` runs the same prefill as embed, layer groups
and head, so each group's pages can be sent while the next group computes.
"""
from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpd.engine.compile.executable_cache import Executables
from jaxpd.engine.scheduling.page_allocator import pages_for
from jaxpd.engine.programs.program import Program
from jaxpd.sizes import coarse_ceil, coarse_sizes
from jaxpd.engine.programs.penalties import prefill_context
from jaxpd.engine.programs.sampler import SamplingArrays, sample
from jaxpd.models.config import ModelConfig
from jaxpd.engine.programs.kernels import prefill_attention, prefill_kernel
from jaxpd.engine.programs.experts import held_experts
from jaxpd.models.layout import is_stacked, unstack_layers
from jaxpd.models.llama import Llama, layer_kinds, prefill_blocks
from jaxpd.engine.programs.decode_runner import CompileCounter


class PrefillRunner:
    """`fused`: `params` are `fuse_params`'s tree (`place_params` says which).
    `quant_matmul`: the product of quantized weights (`models.quant.native_dot`) where
    the params hold them and a native product serves, else None.
    `gather_pages`: cut pages come out replicated over the mesh rather than split over
    its kv heads, so one process of a mesh spanning several holds them whole (the
    leader of `engine.multihost`, which sends them on)."""

    def __init__(self, cfg: ModelConfig, params, mesh: Mesh, rules, page_size: int,
                 counter: CompileCounter, dtype=jnp.float32, name: str = "prefill",
                 fused: bool = False, gather_pages: bool = False,
                 attention_impl: str = "reference", quant_matmul: Callable | None = None):
        self.cfg, self.params, self.mesh, self.page_size = cfg, params, mesh, page_size
        self.dtype = dtype
        self.quant_matmul = quant_matmul
        self.counter, self.name = counter, name
        self._unstacked = None
        self.executables = Executables()       # `run`'s programs installed by warm-up
        attention = prefill_attention(attention_impl, mesh, rules, cfg.head_dim)
        self.kernel = prefill_kernel(attention)
        # On a decode mesh (its own prefills) experts stay where its rules split them.
        experts = held_experts(rules, mesh)
        model = Llama(cfg, dtype, fused, prefill_attention=attention, experts=experts,
                      qmatmul=quant_matmul)
        replicated = NamedSharding(mesh, P())

        def first_token(logits, tokens, lengths, sampling):
            context = lambda: prefill_context(tokens, lengths, sampling.prompt_len,
                                              logits.shape[-1])
            return sample(logits, sampling, lengths, context)

        def prefill(params, tokens, lengths, sampling):
            with nn.logical_axis_rules(rules):
                logits, k, v = model.apply({"params": params}, tokens, lengths,
                                           method=Llama.prefill)
            first, logprobs = first_token(logits, tokens, lengths, sampling)
            return first, logprobs, k, v

        def embed(params, tokens):
            with nn.logical_axis_rules(rules):
                return model.apply({"params": params}, tokens, method=Llama.embed_prompt)

        def blocks(layer_params, x, kinds):
            with nn.logical_axis_rules(rules):
                return prefill_blocks(cfg, dtype, layer_params, x, fused, attention, kinds,
                                      experts)

        def head(params, x, tokens, lengths, sampling):
            with nn.logical_axis_rules(rules):
                logits = model.apply({"params": params}, x, lengths, method=Llama.head)
            return first_token(logits, tokens, lengths, sampling)

        # Explicit output shardings (what GSPMD picks anyway: hidden states replicated,
        # K/V split over kv heads when they divide tp): jax 0.9.1/0.9.2 instead raise
        # IndivisibleError when it has to infer them for 2 KV heads on tp=4.
        kv = NamedSharding(mesh, P(None, None, None, dict(rules).get("kv_heads"), None))
        self._replicated = replicated
        self._prefill = jax.jit(prefill, out_shardings=(replicated, replicated, kv, kv))
        self._embed = jax.jit(embed, out_shardings=replicated)
        self._blocks = jax.jit(blocks, out_shardings=(replicated, kv, kv), static_argnums=(2,))
        # The same program with its layers' kinds bound, for lowering (`layerwise_programs`):
        # an exported function takes arrays only.
        self._blocks_of = lambda kinds: jax.jit(functools.partial(blocks, kinds=kinds),
                                                out_shardings=(replicated, kv, kv))
        self._head = jax.jit(head, out_shardings=replicated)
        pages = replicated if gather_pages else kv
        self._kv, self._cut = kv, pages
        self._takes: dict[int, Callable] = {}

    def run(self, tokens: np.ndarray, lengths: np.ndarray, sampling: SamplingArrays):
        """tokens [B, T] -> (first tokens as numpy [B], their `Logprobs` as numpy when
        some row asks for them (else None: not read back), k, v [L, B, T, K, H] on the
        mesh)."""
        self.counter.note(self.name, tokens.shape)
        prefill = self.executables.get(tokens.shape, self._prefill)
        first, logprobs, k, v = prefill(*self._run_args(tokens, lengths, sampling))
        return (np.asarray(first), jax.device_get(logprobs) if sampling.wants_logprobs else None,
                k, v)

    def _run_args(self, tokens, lengths, sampling):
        return (self.params, *jax.device_put((tokens, lengths, sampling), self._replicated))

    def run_program(self, tokens: np.ndarray, lengths: np.ndarray,
                    sampling: SamplingArrays) -> Program:
        """The program `run` dispatches for these inputs' shapes."""
        b, t = tokens.shape
        return Program(f"{self.name}_b{b}_t{t}", self._prefill,
                       self._run_args(tokens, lengths, sampling), self.kernel,
                       note=functools.partial(self.counter.note, self.name, tokens.shape),
                       install=functools.partial(self.executables.put, tokens.shape))

    def layerwise_programs(self, tokens: np.ndarray, lengths: np.ndarray,
                           sampling: SamplingArrays, groups: list[tuple[int, int]]
                           ) -> list[Program]:
        """The programs `run_layerwise` dispatches for these inputs' shapes (embed, one
        per distinct group size, head; the page cuts of its rows are `take_pages`')."""
        b, t = tokens.shape
        inputs = jax.device_put((tokens, lengths, sampling), self._replicated)
        x = jax.eval_shape(self._embed, self.params, inputs[0])
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._replicated)
        programs = [Program(f"{self.name}_embed_b{b}_t{t}", self._embed,
                            (self.params, inputs[0]))]
        for size in sorted({stop - start for start, stop in groups}):
            start = next(s for s, e in groups if e - s == size)
            layers = self._layer_params(start, start + size)
            programs.append(Program(f"{self.name}_blocks{size}_b{b}_t{t}",
                                    self._blocks_of(layer_kinds(self.cfg, start, start + size)),
                                    (layers, x), self.kernel))
        programs.append(Program(f"{self.name}_head_b{b}_t{t}", self._head,
                                (self.params, x, *inputs)))
        return programs

    def run_layerwise(self, tokens: np.ndarray, lengths: np.ndarray, sampling: SamplingArrays,
                      groups: list[tuple[int, int]], rows: list[tuple[int, int]]):
        """`run`, one layer group at a time, every program dispatched before returning.

        groups: [start, stop) layer ranges covering every layer, in order;
        rows: (row, first_page, num_pages) of the requests whose pages to cut.
        Returns (first tokens on device [B], their `Logprobs` on device, parts):
        parts[g] is a list, per entry of `rows`, of that row's (k, v) pages of group g,
        [stop - start, P, S, K, H].
        Dispatch order is embed, group 0, its pages, group 1, its pages, ..., last
        group, head, its pages: a device runs programs in order, so group g's pages are
        ready while group g+1 still computes, and the caller can send them meanwhile.
        """
        self.counter.note(f"{self.name}_embed", tokens.shape)
        self.counter.note(f"{self.name}_head", tokens.shape)
        inputs = jax.device_put((tokens, lengths, sampling), self._replicated)
        x = self._embed(self.params, inputs[0])
        parts, first, logprobs = [], None, None
        for g, (start, stop) in enumerate(groups):
            kinds = layer_kinds(self.cfg, start, stop)
            self.counter.note(f"{self.name}_blocks", (tokens.shape, kinds))
            x, k, v = self._blocks(self._layer_params(start, stop), x, kinds)
            if g == len(groups) - 1:
                first, logprobs = self._head(self.params, x, *inputs)
            parts.append(self.take_rows(k, v, rows))
        return first, logprobs, parts

    def _layer_params(self, start: int, stop: int) -> list:
        """Each layer's own params, start .. stop - 1 (what `prefill_blocks` takes). The
        engine gives a layer-wise prefill mesh unstacked params; stacked ones (a mesh
        that scans its layers) are unstacked once, on first use."""
        if is_stacked(self.params):
            if self._unstacked is None:
                self._unstacked = unstack_layers(self.cfg, self.params)
            return [self._unstacked[f"layers_{i}"] for i in range(start, stop)]
        return [self.params[f"layers_{i}"] for i in range(start, stop)]

    def take_rows(self, k, v, rows: list[tuple[int, int, int]]):
        """`take_pages` for each (row, first_page, num_pages) of `rows`, in order."""
        return [self.take_pages(k, v, row, n, first) for row, first, n in rows]

    def take_pages(self, k, v, row: int, num_pages: int, first_page: int = 0):
        """Pages `first_page` .. `first_page + num_pages - 1` of row `row`, then padding
        up to `coarse_ceil(num_pages)` (what a handoff carries): ([L, P, S, K, H], same).
        One program per bucket shape and padded count; where they start is an input."""
        padded = coarse_ceil(num_pages)
        self.counter.note(f"{self.name}_take_pages", (k.shape, padded))
        take = self.executables.get(("take", k.shape, padded), self._take_of(padded))
        return take(k, v, np.int32(row), np.int32(first_page * self.page_size))

    def take_programs(self, kv_shape: tuple[int, ...]) -> list[Program]:
        """The programs `take_pages` dispatches for K and V of `kv_shape` [L, B, T, K, H]
        (a batch's, or a layer group's): one per padded page count a row of T tokens
        can send."""
        k = jax.ShapeDtypeStruct(kv_shape, self.dtype, sharding=self._kv)
        programs = []
        for m in coarse_sizes(pages_for(kv_shape[2], self.page_size)):
            programs.append(Program(
                f"{self.name}_take_m{m}_l{kv_shape[0]}_b{kv_shape[1]}_t{kv_shape[2]}",
                self._take_of(m), (k, k, np.int32(0), np.int32(0)),
                host_sharding=self._replicated,
                note=functools.partial(self.counter.note, f"{self.name}_take_pages",
                                       (kv_shape, m)),
                install=functools.partial(self.executables.put, ("take", kv_shape, m))))
        return programs

    def _take_of(self, num_pages: int) -> Callable:
        """`_take_pages` with `num_pages` bound, jitted once per count: a function of
        arrays only, so warm-up can compile it ahead (`take_programs`)."""
        if num_pages not in self._takes:
            self._takes[num_pages] = jax.jit(
                lambda k, v, row, start: self._take_pages(k, v, row, num_pages, start),
                out_shardings=(self._cut, self._cut))
        return self._takes[num_pages]

    def _take_pages(self, k, v, row, num_pages, start):
        n = num_pages * self.page_size
        def cut(x):
            x = jax.lax.dynamic_index_in_dim(x, row, axis=1, keepdims=False)
            # Padded past the bucket's end, so the slice never shifts back to fit.
            x = jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
            x = jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)
            return x.reshape(x.shape[0], num_pages, self.page_size, *x.shape[2:])
        return cut(k), cut(v)
