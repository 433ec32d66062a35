"""`Topology`: how an engine lays out its work, decided once from its config.

Which meshes this process has, which loops run on them, where a prompt is prefilled
(the prefill mesh, the decode mesh's own `PrefillLoop`, or into its slot by the
`ExtendLoop`), and what the prefill loop computes into. `Engine` builds what the value
names and nothing else, and `Routing` sends each prompt where it says. Plain Python.
"""
from __future__ import annotations

import dataclasses

from jaxpd.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class Topology:
    """Every field is a fact about one engine's layout (see `of` for how each follows
    from the config)."""
    prefill_mesh: bool        # a mesh that prefills whole prompts (or colocated: the one)
    decode_mesh: bool         # a mesh that decodes (or colocated: the one)
    colocated: bool           # one mesh, both phases, one loop thread
    decode_caching: bool      # the decode pool caches prefixes by content
    prefill_caching: bool     # the prefill mesh keeps a prefix cache of its own
    paged_prefill: bool       # the prefill loop computes into a paged pool (`PrefillCache`)
    chunked_in_slots: bool    # colocated chunked prefill: every prompt into its slot
    prefill_loop: bool        # a `PrefillLoop` runs on the prefill mesh
    local_prefill: bool       # the decode mesh prefills prompts itself (short, or all)
    local_loop: bool          # ... with a `PrefillLoop` of its own (else the extend loop)
    extend_loop: bool         # an `ExtendLoop` prefills into slots on the decode mesh
    extend_all: bool          # every prompt goes to the extend loop
    layerwise: bool           # buckets of `layerwise_min_tokens` and more send their KV
                              # in layer groups while computing (not from a paged pool)
    in_process_handoffs: bool  # a prefill and a decode mesh in this one process
    threads: tuple[str, ...]  # the loop threads this engine runs

    @classmethod
    def of(cls, config: EngineConfig, multi_process: bool = False) -> "Topology":
        """The layout `config` asks for; `multi_process`: this one-role mesh spans
        processes (`engine.multihost`)."""
        spec = config.mesh
        colocated = spec.colocated
        decode_caching = bool(config.enable_prefix_caching) and spec.has_decode
        prefill_caching = bool(config.enable_prefix_caching) and spec.has_prefill \
            and not colocated
        # Colocated with chunks: every prompt is prefilled into its slot on the one mesh,
        # at most `chunked_prefill_tokens` between two decode steps.
        chunked_in_slots = config.chunked_prefill_tokens is not None and \
            config.buckets[-1] > config.chunked_prefill_tokens
        # A prefill mesh of its own in one process, not elastic, without layer-wise
        # transfer (which sends from the dense bucket), computes into pages: a handoff's
        # pages are gathered by programs compiled ahead, long prompts go in chunks.
        pages = (not colocated and not spec.elastic and not multi_process
                 and config.layerwise_min_tokens == 0)
        extend_loop = spec.has_decode and (decode_caching or chunked_in_slots)
        extend_all = (colocated or not spec.has_prefill) and (decode_caching or chunked_in_slots)
        local_prefill = spec.has_decode and not colocated and (
            config.local_prefill_below > 0 or not spec.has_prefill)
        prefill_loop = spec.has_prefill and not (colocated and extend_all)
        threads = (("jaxpd-engine",) if colocated else
                   ("jaxpd-prefill",) * spec.has_prefill + ("jaxpd-decode",) * spec.has_decode)
        return cls(
            prefill_mesh=spec.has_prefill, decode_mesh=spec.has_decode, colocated=colocated,
            decode_caching=decode_caching, prefill_caching=prefill_caching,
            paged_prefill=prefill_loop and (prefill_caching or pages),
            chunked_in_slots=chunked_in_slots, prefill_loop=prefill_loop,
            local_prefill=local_prefill, local_loop=local_prefill and not decode_caching,
            extend_loop=extend_loop, extend_all=extend_all,
            layerwise=(prefill_loop and not colocated and config.layerwise_min_tokens > 0
                       and not (prefill_caching or pages)),
            in_process_handoffs=spec.has_prefill and spec.has_decode and not colocated,
            threads=threads)
