"""`EngineStats`: what an engine has done and holds, one typed snapshot.

Its fields are the public Stats RPC's names; the same snapshot feeds the Stats RPC,
Prometheus (each field's `kind` and `help`) and the bench, so a count is spelled once.
`StatsCounter` is the live, thread-safe side: the loops, the transfer threads and the
connectors add to it from their own threads under one lock.
(Plain Python: importing this loads no jax.)
"""
from __future__ import annotations

import collections.abc
import dataclasses
import threading


def _counter(help: str, default=0, metric: str | None = None):
    """A monotonic count; exported as `metric` (default `jaxpd_<field>_total`)."""
    return dataclasses.field(default=default,
                             metadata={"kind": "counter", "help": help, "metric": metric})


def _gauge(help: str):
    """A level that goes up and down; exported as `jaxpd_<field>`."""
    return dataclasses.field(default=0, metadata={"kind": "gauge", "help": help})


@dataclasses.dataclass(frozen=True)
class EngineStats(collections.abc.Mapping):
    """A snapshot; also a read-only mapping of its fields (for RPC and export)."""
    mesh: str = ""
    compiled_programs: dict = dataclasses.field(default_factory=dict)
    num_compiled_programs: int = _counter(
        "Programs compiled (distinct shapes over all jitted functions).",
        metric="jaxpd_compiled_programs_total")
    prefill_batches: int = _counter("Prefill batches run.")
    prefill_tokens: int = _counter("Prompt tokens prefilled (the same count as "
                                   "prefill_computed_tokens).")
    prefill_computed_tokens: int = _counter(
        "Tokens whose KV a prefill or extend program computed, on every path (the prefill "
        "mesh, its chunks, the decode mesh's own prefills and extends, colocated), padding "
        "excluded; a cached prefix is not computed, so cache on against off shows what "
        "the cache saved.")
    prefill_padded_tokens: int = _counter("Prefill tokens computed, bucket padding included.")
    local_prefills: int = _counter("Requests prefilled on the decode mesh (no transfer).")
    transfers: int = _counter("KV-cache transfers from prefill to decode.")
    layerwise_transfers: int = _counter("KV-cache transfers sent layer group by layer group.")
    transfer_bytes: int = _counter("Bytes of KV cache transferred.")
    transfer_s: float = _counter("Seconds spent transferring KV cache.", 0.0,
                                 metric="jaxpd_transfer_seconds_total")
    transfer_failures: int = _counter("KV transfers that failed (the request was prefilled again "
                                      "or failed over).")
    kv_streams_rejected: int = _counter("Inbound KV streams rejected as damaged or malformed.")
    handoffs_rejected: int = _counter("KV handoffs refused before any device op: for no "
                                      "request here, or contradicting this side's pages, "
                                      "limits or vocabulary.")
    handoffs_model_mismatch: int = _counter("KV handoffs refused because another model computed "
                                            "them (their fingerprint is not this pool's); the "
                                            "request was prefilled again here.")
    offers_reclaimed: int = _counter("KV offers ended by the sender because nobody pulled them.")
    kv_pieces_pulled: int = _counter("KV pieces pulled, each from the process of a prefill mesh "
                                     "spanning processes that holds those kv heads.")
    prefix_query_tokens: int = _counter("Tokens looked up in the prefix cache (decode side).")
    prefix_hit_tokens: int = _counter("Tokens whose KV came from the prefix cache (not computed "
                                      "or not inserted).")
    prefix_host_hit_tokens: int = _counter("Tokens whose KV came back from the host tier "
                                           "(restored into the pool, not computed); not in "
                                           "prefix_hit_tokens.")
    host_tier_stored_pages: int = _counter("Pages the decode pool evicted that the host tier "
                                           "stored.")
    host_tier_restored_pages: int = _counter("Pages restored from the host tier into the "
                                             "decode pool.")
    host_tier_corrupt_pages: int = _counter("Host tier pages refused on restore: their bytes "
                                            "did not match their checksum (dropped, computed "
                                            "instead).")
    prefill_cache_host_hit_tokens: int = _counter("Tokens the prefill mesh restored from its "
                                                  "host tier (not computed); not in "
                                                  "prefill_cache_hit_tokens.")
    prefill_host_tier_stored_pages: int = _counter("Pages the prefill mesh's cache evicted "
                                                   "that its host tier stored.")
    prefill_host_tier_restored_pages: int = _counter("Pages restored from the prefill mesh's "
                                                     "host tier into its cache.")
    prefill_host_tier_corrupt_pages: int = _counter("Prefill host tier pages refused on "
                                                    "restore: their bytes did not match their "
                                                    "checksum (dropped, computed instead).")
    host_tier_evicted_pages: int = _counter("Pages the decode pool's host tier dropped for room "
                                            "(least recently used first).")
    prefill_host_tier_evicted_pages: int = _counter("Pages the prefill mesh's host tier dropped "
                                                    "for room (least recently used first).")
    prefill_cache_query_tokens: int = _counter("Tokens looked up in the prefill mesh's own prefix "
                                               "cache.")
    prefill_cache_hit_tokens: int = _counter("Tokens the prefill mesh found in its prefix cache "
                                             "(not computed).")
    prefill_cache_cold_batches: int = _counter("Prefill batches computed without their cached "
                                               "prefix: its program was still compiling in the "
                                               "background.")
    extend_cold_requests: int = _counter("Requests routed to the decode mesh's prefill with "
                                         "context that went through the prefill mesh instead: "
                                         "the program their prefix needed by then was still "
                                         "compiling in the background.")
    prefix_evictions: int = _counter("Cached pages evicted to make room.")
    prefix_saved_bytes: int = _counter("Bytes of KV cache a handoff did not carry: the leading "
                                       "pages the decode side held cached.")
    prefix_skip_misses: int = _counter("Handoffs that left out pages the decode side no longer "
                                       "held (evicted meanwhile): prefilled again in full.")
    handoff_waits_expired: int = _counter("Prefill batches that started before the decode side "
                                          "had pulled the previous handoffs "
                                          "(`handoff_wait_ms` ran out).")
    decode_steps: int = _counter("Decode steps run.")
    resplits: int = _counter("Elastic re-splits: devices moved between the prefill and decode "
                             "meshes.")
    split_vetoes: int = _counter("Moves the elastic split controller wanted and its latency "
                                 "model vetoed (the giving role would break its SLO, or the "
                                 "receiving role would not gain enough).")
    resplit_moved_requests: int = _counter("Decoding requests whose KV a re-split moved to the "
                                           "new decode mesh (not recomputed).")
    migrations_out: int = _counter("Decode worker: decoding requests whose KV and sampling "
                                   "state were cut out of its pool to go on at another "
                                   "decode worker (a drain).")
    migrations: int = _counter("Router: requests whose KV a drained decode worker sent to "
                               "another, to go on there from their next token (not prefilled "
                               "again); those whose KV did not land count in "
                               "migration_failures too.")
    migration_fallbacks: int = _counter("Router: moves the drained decode worker could not "
                                        "send (target gone, transfer error): the request was "
                                        "prefilled again instead.")
    migration_failures: int = _counter("Moves whose KV the drained decode worker sent but "
                                       "that did not land (the target's pull or its checks "
                                       "failed): the target prefilled the request again. "
                                       "Counted by the target decode worker and the router.")
    preemptions: int = _counter("Requests preempted for lack of pages.")
    finished: int = _counter("Requests finished (stop or length).",
                             metric="jaxpd_requests_finished_total")
    aborted: int = _counter("Requests aborted (cancel, deadline, shutdown, failure).",
                            metric="jaxpd_requests_aborted_total")
    slots_total: int = _gauge("Decode slots in all dp shards.")
    slots_active: int = _gauge("Decode slots in use.")
    pages_total: int = _gauge("KV-cache pages in all dp shards.")
    pages_used: int = _gauge("KV-cache pages in use.")
    pages_cached: int = _gauge("KV-cache pages nobody uses that keep a cached prefix "
                               "(evicted when room is needed).")
    prefill_pages_cached: int = _gauge("Prefill-mesh cache pages that hold a cached prefix "
                                       "(none is in use between batches).")
    host_tier_pages: int = _gauge("Pages the decode pool's host tier holds.")
    host_tier_bytes: int = _gauge("Bytes the decode pool's host tier holds.")
    prefill_host_tier_pages: int = _gauge("Pages the prefill mesh's host tier holds.")
    prefill_host_tier_bytes: int = _gauge("Bytes the prefill mesh's host tier holds.")
    queue_waiting: int = _gauge("Requests waiting for prefill.")
    prefill_devices: int = _gauge("Devices of the prefill mesh (an elastic split moves them).")
    decode_devices: int = _gauge("Devices of the decode mesh (an elastic split moves them).")

    def __getitem__(self, key: str):
        if key not in _NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in _NAMES}


_NAMES = tuple(f.name for f in dataclasses.fields(EngineStats))


def exported() -> list[tuple[str, str, str, str]]:
    """(field, metric name, kind, help) of every field Prometheus exports."""
    out = []
    for f in dataclasses.fields(EngineStats):
        kind = f.metadata.get("kind")
        if kind is not None:
            suffix = "_total" if kind == "counter" else ""
            out.append((f.name, f.metadata.get("metric") or f"jaxpd_{f.name}{suffix}", kind,
                        f.metadata["help"]))
    return out
# What the engine counts itself (the compile counter keeps its own count).
COUNTERS = tuple(f.name for f in dataclasses.fields(EngineStats)
                 if f.metadata.get("kind") == "counter" and f.name != "num_compiled_programs")


class StatsCounter:
    """Running counts (by default the engine's). Any thread may `add`; `snapshot` is
    consistent."""

    def __init__(self, names: tuple[str, ...] = COUNTERS):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(names, 0)

    def add(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)
