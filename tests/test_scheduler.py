"""Schedulers in isolation: plain Python, hand-checkable."""
import pytest

from jaxpd.request import Request, State
from jaxpd.sampling_params import SamplingParams
from jaxpd.sizes import coarse_ceil
from jaxpd.engine.scheduling.buckets import (batch_buckets, context_width, context_widths,
                                           length_buckets)
from jaxpd.engine.scheduling.scheduler import DecodeScheduler, PrefillScheduler


def free_pages(d: DecodeScheduler) -> int:
    return sum(a.num_free for a in d.allocators)


def req(n, arrival, rid=None):
    r = Request(rid or f"r{arrival}-{n}", list(range(1, n + 1)), SamplingParams(max_tokens=4))
    r.timings.arrival = arrival
    return r


def test_buckets():
    assert length_buckets(100) == [16, 32, 64, 128]
    assert length_buckets(16) == [16]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]


def test_full_bucket_runs_at_once_and_pads_batch():
    s = PrefillScheduler([16, 32], max_batch=2, max_tokens=64, bucket_timeout_s=1.0)
    s.add(req(3, 0.0))
    assert s.schedule(0.0)[0] is None
    s.add(req(10, 0.1))
    batch, _ = s.schedule(0.1)
    assert [len(r.prompt_ids) for r in batch.requests] == [3, 10]
    assert (batch.batch_size, batch.length) == (2, 16)
    assert len(s) == 0


def test_timeout_releases_a_partial_batch_and_reports_wait():
    s = PrefillScheduler([16, 32], max_batch=4, max_tokens=128, bucket_timeout_s=0.005)
    s.add(req(20, 1.0))
    batch, wait = s.schedule(1.001)
    assert batch is None and wait == pytest.approx(0.004)
    batch, _ = s.schedule(1.006)
    assert batch.length == 32 and batch.batch_size == 1


def test_oldest_bucket_first_no_starvation():
    s = PrefillScheduler([16, 32], max_batch=2, max_tokens=128, bucket_timeout_s=0.005)
    old = req(20, 0.0)
    s.add(old)
    for i in range(6):  # a stream of short requests keeps filling bucket 16
        s.add(req(4, 0.001 + i * 1e-4))
    first, _ = s.schedule(0.0065)
    assert first.requests == [old]


def test_max_prefill_tokens_caps_batch():
    s = PrefillScheduler([16, 64], max_batch=8, max_tokens=128, bucket_timeout_s=0)
    for i in range(5):
        s.add(req(40, i * 0.1))
    batch, _ = s.schedule(1.0)
    assert len(batch.requests) == 2 and batch.batch_size == 2


def test_min_batch_mixes_shorter_buckets_after_timeout():
    s = PrefillScheduler([16, 32], max_batch=4, max_tokens=128, bucket_timeout_s=0, min_batch=2)
    s.add(req(20, 0.0))
    s.add(req(5, 0.1))
    batch, _ = s.schedule(1.0)
    assert len(batch.requests) == 2 and batch.length == 32


def test_aborted_requests_are_dropped():
    s = PrefillScheduler([16], max_batch=4, max_tokens=64, bucket_timeout_s=0)
    r = req(3, 0.0)
    s.add(r)
    r.abort("cancelled")
    assert s.schedule(1.0) == (None, None)


def test_too_long_prompt_is_refused():
    s = PrefillScheduler([16, 32], max_batch=4, max_tokens=64)
    with pytest.raises(ValueError, match="longer than the largest"):
        s.add(req(33, 0.0))


def _decoding(n, arrival):
    r = req(n, arrival)
    r.state = State.DECODING
    return r


def test_decode_admission_picks_shard_with_most_free_pages():
    d = DecodeScheduler(num_shards=2, slots_per_shard=2, pages_per_shard=9, page_size=4)
    a, _ = d.find_slot(10)
    d.admit(a, _decoding(10, 0), 10)              # 3 pages (10 tokens + 1 lookahead)
    b, _ = d.find_slot(10)
    assert d.shard_of(b) != d.shard_of(a)
    assert free_pages(d) == 16 - 3


def test_decode_growth_and_preemption_of_youngest():
    d = DecodeScheduler(num_shards=1, slots_per_shard=2, pages_per_shard=5, page_size=4)
    old, young = _decoding(7, 0.0), _decoding(7, 1.0)
    d.admit(0, old, 7)                            # pages for positions 0..7: 2
    d.admit(1, young, 7)                          # 2 more: 0 free
    plan = d.plan_step()
    assert [e.position for e in plan.entries] == [7, 7] and not plan.preempted
    d.advance(plan)                               # both need page 3 for position 8
    plan = d.plan_step()
    assert plan.preempted == [young]
    assert [e.request for e in plan.entries] == [old]
    assert free_pages(d) == 4 - 3
    d.release(0)
    assert free_pages(d) == 4 and d.num_active() == 0


def test_engine_config_refuses_a_pool_too_small_for_one_request():
    from jaxpd.config import EngineConfig
    with pytest.raises(ValueError, match="pages_per_shard=5 cannot hold one request"):
        EngineConfig(mesh="prefill=1,decode=1", max_model_len=160, page_size=16, pages_per_shard=5)
    EngineConfig(mesh="prefill=1,decode=1", max_model_len=160, page_size=16, pages_per_shard=11)


def test_slot_still_receiving_kv_is_neither_stepped_nor_preempted():
    d = DecodeScheduler(num_shards=1, slots_per_shard=2, pages_per_shard=5, page_size=4)
    arriving, running = _decoding(7, 1.0), _decoding(7, 0.0)
    d.admit(0, running, 7)
    d.admit(1, arriving, 7, ready=False)       # younger, but its KV is still in transfer
    plan = d.plan_step()
    assert [e.request for e in plan.entries] == [running]
    d.advance(plan)                            # running needs a third page: none is free
    plan = d.plan_step()
    assert plan.preempted == [running]         # itself, never the slot being written
    assert d.slots[1].request is arriving
    d.mark_ready(1)
    assert [e.request for e in d.plan_step().entries] == [arriving]


def test_coarse_ceil_wastes_at_most_a_quarter_in_logarithmically_many_sizes():
    assert [coarse_ceil(n) for n in range(1, 18)] == \
        [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]
    sizes = {coarse_ceil(n) for n in range(1, 513)}
    assert len(sizes) == 32 and max(sizes) == 512
    assert all(n <= coarse_ceil(n) <= 1.25 * n for n in range(1, 5000))
    assert all(coarse_ceil(coarse_ceil(n)) == coarse_ceil(n) for n in range(1, 5000))
    with pytest.raises(ValueError, match="positive"):
        coarse_ceil(0)


def test_decode_context_width_is_within_a_quarter_of_the_context_in_steps():
    assert [context_width(n, 4, 64) for n in (1, 4, 5, 8, 9, 33, 63, 64)] == \
        [4, 4, 8, 8, 12, 40, 64, 64]
    assert context_width(7, 4, 6) == 6                 # capped by the slot's pages
    assert context_width(5, 1, 64) == 5                # step 1, small: exactly the context
    assert context_widths(4, 10) == [4, 8, 10]
    assert len(context_widths(8, 512)) == 20           # 8,192 tokens in pages of 16


def test_a_kernel_that_reads_up_to_each_length_needs_one_decode_width():
    assert {context_width(n, 8, 512, by_length=True) for n in range(1, 513)} == {512}
    assert context_widths(8, 512, by_length=True) == [512]
    assert all(context_width(n, 4, 10) in context_widths(4, 10) for n in range(1, 11))
