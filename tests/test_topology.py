"""The engine's layout as one value (`Topology.of`) and where each prompt is prefilled
(`Routing.route`): plain Python, no device."""
import pytest

from jaxpd.config import EngineConfig
from jaxpd.engine.scheduling.inboxes import Inbox, Routing
from jaxpd.engine.topology import Topology
from jaxpd.request import Request
from jaxpd import SamplingParams


def _layout(mesh: str, multi_process: bool = False, **options) -> Topology:
    return Topology.of(EngineConfig(mesh=mesh, max_model_len=1024, **options), multi_process)


def test_disaggregated_in_one_process_prefills_into_pages_with_both_caches():
    t = _layout("prefill=1,decode=1")
    assert (t.prefill_mesh, t.decode_mesh, t.colocated) == (True, True, False)
    assert t.threads == ("jaxpd-prefill", "jaxpd-decode")
    assert t.prefill_loop and t.paged_prefill and t.in_process_handoffs
    assert t.decode_caching and t.prefill_caching and t.extend_loop and not t.extend_all
    assert not t.local_prefill and not t.local_loop and not t.layerwise


def test_colocated_runs_one_thread_and_prefills_whole_prompts_or_into_slots():
    plain = _layout("colocated=1")
    assert plain.threads == ("jaxpd-engine",) and plain.prefill_loop
    assert not (plain.extend_loop or plain.decode_caching or plain.paged_prefill)
    chunks = _layout("colocated=1", chunked_prefill_tokens=256)
    assert chunks.chunked_in_slots and chunks.extend_loop and chunks.extend_all
    assert not chunks.prefill_loop                   # the extend loop is its only prefill
    cached = _layout("colocated=1", enable_prefix_caching=True)
    assert cached.extend_all and not cached.prefill_loop and not cached.prefill_caching


def test_roles_of_their_own_process():
    decode = _layout("decode=2")
    assert decode.threads == ("jaxpd-decode",) and decode.local_prefill
    assert decode.local_loop == (not decode.decode_caching)
    prefill = _layout("prefill=2", multi_process=True, enable_prefix_caching=False)
    assert prefill.threads == ("jaxpd-prefill",) and not prefill.paged_prefill
    assert not (prefill.decode_mesh or prefill.local_prefill or prefill.in_process_handoffs)


def test_layerwise_transfer_sends_from_dense_buckets_not_a_paged_pool():
    t = _layout("prefill=1,decode=1", layerwise_min_tokens=256)
    assert t.layerwise and not t.paged_prefill and not t.prefill_caching
    assert not _layout("elastic=2").paged_prefill    # an elastic split keeps dense buckets


def _request(n: int) -> Request:
    return Request(f"r{n}", list(range(1, n + 1)), SamplingParams(max_tokens=1))


def test_routing_sends_short_prompts_to_the_decode_mesh_and_cached_ones_to_extend():
    short = Routing(has_prefill=True, has_decode=True, local_prefill=True,
                    local_prefill_below=16)
    assert short.route(_request(8)) is Inbox.LOCAL
    assert short.route(_request(40)) is Inbox.PREFILL
    # (in the pool, in the pool or then the host tier)
    cached = {"r40": (0, 32), "r64": (16, 32), "r8": (0, 0)}
    ready = []
    routing = Routing(has_prefill=True, has_decode=True, local_prefill=False,
                      cached_tokens=lambda r: cached[r.request_id],
                      extend_ready=lambda new, hit: not ready.append((new, hit)),
                      extend_below=16, page_size=16)
    assert routing.route(_request(40)) is Inbox.EXTEND       # 8 new tokens after 32 restorable
    assert ready == [(8, 32)]
    long = _request(64)        # a handoff is inserted, never restored: skip pool pages only
    assert routing.route(long) is Inbox.PREFILL and long.kv_skip_pages == 1
    assert routing.route(_request(8)) is Inbox.PREFILL


@pytest.mark.parametrize("has_prefill", [True, False])
def test_routing_with_every_prompt_into_slots(has_prefill):
    every = Routing(has_prefill=has_prefill, has_decode=True, local_prefill=not has_prefill,
                    extend_all=True)
    assert every.route(_request(300)) is Inbox.EXTEND
