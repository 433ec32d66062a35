"""Prefix caching: content-addressed pages, sharing, eviction, and the
decode mesh's prefill with context -- against transformers, with the page accounting
checked after every engine test."""
import time
import types

import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.engine.compile.background import settle
from jaxpd.engine.compile.warmup import likely_prefix_shapes
from jaxpd.models import native_attention
from jaxpd.engine.scheduling.page_allocator import PageAllocator, page_hashes
from jaxpd.engine.scheduling.scheduler import DecodeScheduler
from jaxpd.request import Request, State
from tests.engine_fixtures import XlaCompiles
from tests.hf_fixtures import hf_greedy
from tests.support.prefix_chats import (chat, chats_at_once, check_pool, conversation,
                                        greedy, page_bytes, start_workers)

ROOT = b"test-root"


# ---- hashes and the allocator (plain Python) ---------------------------------------

def test_page_hashes_chain_over_full_pages_only():
    ids = list(range(3, 40))
    h = page_hashes(ids, 8, ROOT)
    assert len(h) == 4                                   # 37 tokens: 4 full pages of 8
    assert page_hashes(ids[:32] + [99, 98], 8, ROOT) == h   # the partial page is not hashed
    assert page_hashes(ids[:16], 8, ROOT) == h[:2]       # a prefix has the prefix's hashes
    other = page_hashes([4] + ids[1:], 8, ROOT)          # an earlier token changes them all
    assert all(a != b for a, b in zip(h, other))
    assert page_hashes(ids, 8, b"another model") != h
    # Page 2 alone equal, after different pages: a different hash (chained).
    shifted = page_hashes([0] * 16 + ids[16:24], 8, ROOT)
    assert shifted[2] != h[2]


def test_allocator_shares_caches_and_evicts_least_recently_used():
    a = PageAllocator(6)                                 # 5 usable
    p = a.allocate(3)
    h = page_hashes(list(range(24)), 8, ROOT)
    assert [a.publish(page, hh) for page, hh in zip(p, h)] == [True] * 3
    a.share(p[:2])                                       # a second request maps two of them
    assert a.refs(p[0]) == 2 and a.num_used == 3
    a.free(p)                                            # the first request ends
    assert a.num_used == 2 and a.num_cached_free == 1 and a.num_free == 3
    a.check()
    assert a.cached_prefix(h) == p                       # still findable, all three
    a.free(p[:2])
    assert a.num_used == 0 and a.num_cached_free == 3 and a.num_free == 5
    a.check()
    a.share([p[0]])                                      # reused: leaves the LRU
    assert a.num_cached_free == 2
    a.free([p[0]])                                       # now the most recently used
    # Two never-used pages go first; then the LRU's oldest (p[1], p[2]), p[0] last.
    got = a.allocate(4)
    assert p[0] not in got and a.num_evictions == 2
    assert a.cached_prefix(h) == [p[0]]                  # p[1] evicted: the chain stops
    a.check()
    assert a.allocate(1) == [p[0]] and a.num_evictions == 3 and a.cached_prefix(h) == []
    a.check()


def test_allocator_evicts_a_released_prefix_from_its_tail():
    """A released request's pages are evicted last page first: what stays of its
    prefix is still found (a head evicted first would strand the rest, cached but
    unreachable)."""
    a = PageAllocator(6)                                 # 5 usable
    p = a.allocate(4)
    h = page_hashes(list(range(32)), 8, ROOT)
    assert all(a.publish(page, hh) for page, hh in zip(p, h))
    a.free(p)
    a.allocate(2)                                        # one never-used, one evicted
    assert a.num_evictions == 1 and a.cached_prefix(h) == p[:3]
    a.allocate(2)
    assert a.num_evictions == 3 and a.cached_prefix(h) == p[:1]
    a.check()


def test_allocator_refuses_misuse():
    a = PageAllocator(4)
    p = a.allocate(2)
    h = page_hashes(list(range(16)), 8, ROOT)
    assert a.publish(p[0], h[0])
    assert not a.publish(p[1], h[0])                     # same contents elsewhere: private
    assert a.publish(p[0], h[0])                         # idempotent
    with pytest.raises(ValueError, match="not cached"):
        a.share([p[1]])
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free([p[1]])
    with pytest.raises(ValueError, match="not in use"):
        a.publish(p[1], h[1])
    a.check()


def _request(ids, state=State.DECODING):
    r = Request(request_id=f"r{id(ids)}", prompt_ids=list(ids),
                params=SamplingParams(max_tokens=100))
    r.state = state
    return r


def test_scheduler_prefers_the_shard_holding_the_prefix_and_never_shares_a_written_page():
    d = DecodeScheduler(num_shards=2, slots_per_shard=2, pages_per_shard=12, page_size=4,
                        prefix_root=ROOT)
    ids = list(range(10, 30))                            # 20 tokens: 5 full pages
    slot, shared = d.find_slot(20, ids)
    assert shared == []
    first = _request(ids)
    d.admit(slot, first, 20)                             # ready: its full pages publish
    assert d.allocators[d.shard_of(slot)].num_cached == 5
    # A follow-up (the same 20 tokens and 3 more) lands on the same shard, sharing all 5.
    follow = ids + [7, 8, 9]
    slot2, shared2 = d.find_slot(23, follow)
    assert d.shard_of(slot2) == d.shard_of(slot) and shared2 == d.slots[slot].pages[:5]
    # Capped: a prefill with context computes at least the last token.
    assert len(d.find_slot(20, ids, max_shared=(20 - 1) // 4)[1]) == 4
    second = _request(follow)
    pages = d.admit(slot2, second, 23, shared=shared2)
    assert pages[:5] == shared2 and d.slots[slot2].num_shared == 5
    plan = d.plan_step()
    # Every write lands at a position past the shared pages.
    for e in plan.entries:
        s = d.slots[e.slot]
        assert e.position // 4 >= s.num_shared
    d.release(slot)
    d.release(slot2)
    for a in d.allocators:
        a.check()
        assert a.num_used == 0 and a.num_free == a.capacity


def test_scheduler_counts_cached_pages_as_room_but_not_the_ones_it_shares():
    d = DecodeScheduler(num_shards=1, slots_per_shard=3, pages_per_shard=6, page_size=4,
                        prefix_root=ROOT)                # 5 usable pages
    ids = list(range(50, 66))                            # 16 tokens: 4 full pages + 1
    d.admit(0, _request(ids), 16)                        # 5 pages, 4 published
    d.release(0)
    alloc = d.allocators[0]
    assert alloc.num_cached_free == 4 and alloc.num_free == 5
    # 16 shared tokens + 4 new: 4 shared pages, 2 own; only 1 page is really free.
    assert d.find_slot(20, ids + [1, 2, 3, 4]) is None
    # Without sharing, the LRU is room: evicted to admit a stranger of 16 tokens.
    slot, shared = d.find_slot(16, list(range(100, 116)))
    assert shared == []
    d.admit(slot, _request(list(range(100, 116))), 16)
    assert alloc.num_evictions == 4
    alloc.check()


# ---- the engine, against transformers ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["prefill=2,decode=1x2"])   # colocated: the warm-up test
def test_multiturn_greedy_matches_hf_and_computes_only_the_new_tokens(hf_models, mesh):
    """Head dim 32: on a CPU with AVX-512 the decode mesh's prefill with context runs
    the native kernels (the prefix read in place from the pool) on each tp shard."""
    path, hf_model = hf_models("llama_gqa", hidden_size=256)
    system, users = conversation(np.random.default_rng(0), turns=4)
    with LLM(path, mesh=mesh, max_model_len=192, slots_per_shard=2,
             enable_prefix_caching=True, warmup=False) as llm:
        native = native_attention.prefill_available(32)
        assert llm.engine.decode_runner.extend_kernel == ("native" if native else "reference")
        conv = list(system)
        for t, user in enumerate(users):
            before = llm.stats()
            conv += user
            out = llm.generate(prompt_token_ids=[conv], sampling_params=greedy(6))[0]
            assert out.token_ids == hf_greedy(hf_model, conv, 6)
            after = llm.stats()
            computed = after["prefill_tokens"] - before["prefill_tokens"]
            hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
            # The previous turn's full pages (prompt and answer) were cached: KV exists
            # for all of it but its last token, or all of it when its finished slot
            # rode along one more step. Only the rest is computed (at least one token).
            previous = len(conv) - len(user)
            low, high = (previous - 1) // 16 * 16, min(previous, len(conv) - 1) // 16 * 16
            assert (hit == 0) if t == 0 else (low <= hit <= high), (hit, low, high)
            assert computed == len(conv) - hit
            if t > 0:
                assert after["local_prefills"] > before["local_prefills"]   # no trip
            conv += out.token_ids
        assert llm.stats()["prefix_evictions"] == 0
        check_pool(llm)
        assert llm.stats()["pages_cached"] > 0


# dp=2: two pools, each with its own cache; a shard is chosen by its cached prefix.
# prefill=1: the prefill mesh's cache, at the least that admits its largest batch (4
# rows of 6 pages and the null page), evicts too.
@pytest.mark.slow
# Head dim 32 on the prefill mesh: on a CPU with AVX-512 its prefills with context read
# their prefix with the native kernel; head dim 8 on the colocated one: the reference.
@pytest.mark.parametrize("mesh,model,extra", [
    ("colocated=2", {}, {}),
    ("prefill=1,decode=1", dict(hidden_size=256), dict(prefill_cache_pages=25,
                                                       max_prefill_batch=4,
                                                       prefix_extend_below=0))])
def test_cache_off_and_on_agree_with_concurrent_sharers_and_a_tiny_pool(hf_models, mesh,
                                                                        model, extra):
    """Many requests sharing a system prompt at once on a pool that must evict: every
    output equals transformers', cached pages are evicted (never one in use), and the
    accounting is exact afterwards."""
    path, hf_model = hf_models("llama_gqa", **model)
    rng = np.random.default_rng(1)
    system = rng.integers(3, 256, 40).tolist()
    prompts = [system + rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 40, 12)]
    prompts += [rng.integers(3, 256, 50).tolist() for _ in range(4)]     # strangers
    expected = [hf_greedy(hf_model, p, 8) for p in prompts]
    # 2 slots x 6 pages + null: a full shard holds two requests, nothing else.
    with LLM(path, mesh=mesh, max_model_len=96, slots_per_shard=2,
             pages_per_shard=13, enable_prefix_caching=True, **extra, warmup=False) as llm:
        for round_ in range(2):
            outs = llm.generate(prompt_token_ids=prompts,
                                sampling_params=[greedy(8)] * len(prompts))
            assert [o.token_ids for o in outs] == expected
        stats = llm.stats()
        assert stats["prefix_hit_tokens"] > 0 and stats["prefix_evictions"] > 0
        assert stats["finished"] == 2 * len(prompts) and stats["aborted"] == 0
        cache = llm.engine.prefill_cache
        if cache is not None:
            assert stats["prefill_cache_hit_tokens"] > 0 and cache.allocator.num_evictions > 0
        check_pool(llm)


@pytest.mark.slow
def test_abort_and_preemption_of_requests_sharing_pages_release_exactly_their_refs(
        tiny_hf_model):
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(2)
    system = rng.integers(3, 256, 48).tolist()            # 3 full pages, shared
    prompts = [system + rng.integers(3, 256, 3).tolist() for _ in range(4)]
    with LLM(path, mesh="colocated=1", max_model_len=128, slots_per_shard=4,
             pages_per_shard=13, enable_prefix_caching=True, warmup=False) as llm:
        llm.generate(prompt_token_ids=[system + [5]], sampling_params=[greedy(1)])
        reqs = [llm.submit(llm.make_request(prompt_token_ids=p, sampling_params=greedy(60)))
                for p in prompts]
        llm.abort(reqs[0].request_id)
        outs = [llm._wait(r) for r in reqs]
        assert outs[0].finish_reason == "abort"
        # 4 requests of 51 + 60 tokens cannot all fit 12 pages: preemption recomputes
        # them from the shared pages, and the outputs stay exact.
        for p, o in zip(prompts[1:], outs[1:]):
            assert o.token_ids == hf_greedy(hf_model, p, 60)
        assert llm.stats()["preemptions"] > 0
        check_pool(llm)


@pytest.mark.slow
def test_a_handoff_carries_only_the_pages_the_decode_side_does_not_hold(tiny_hf_model):
    """With the extend threshold at 0, every prompt goes through the prefill mesh; its
    handoff leaves out the cached prefix the decode side holds (bytes moved are exactly
    the rest), which the decode side maps instead of inserting."""
    path, hf_model = tiny_hf_model
    system, users = conversation(np.random.default_rng(3), turns=3)
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=192, slots_per_shard=2,
             enable_prefix_caching=True, prefix_extend_below=0, warmup=False) as llm:
        page = page_bytes(llm)
        conv, moved, saved = list(system), [], []
        for user in users:
            before = llm.stats()
            conv = chat(llm, hf_model, conv, [user])
            after = llm.stats()
            moved.append(after["transfer_bytes"] - before["transfer_bytes"])
            saved.append(after["prefix_saved_bytes"] - before["prefix_saved_bytes"])
            prompt = len(conv) - 6
            # Every page of the prompt is either moved or known to be held.
            assert moved[-1] + saved[-1] == -(-prompt // 16) * page
        assert saved[0] == 0 and all(s >= 2 * page for s in saved[1:])
        stats = llm.stats()
        assert stats["transfers"] == 3 and stats["local_prefills"] == 0
        assert stats["prefix_hit_tokens"] > 0 and stats["prefix_skip_misses"] == 0
        check_pool(llm)


@pytest.mark.slow
def test_a_handoff_whose_cached_pages_were_evicted_meanwhile_is_prefilled_again(
        tiny_hf_model):
    """The race the issue names: the decode side held a prefix when the request was
    routed, then evicted it before the handoff (which left those pages out) arrived.
    Forced here by dropping the decode cache right before that handoff is admitted:
    it is refused, the request is prefilled again with every page, and its tokens are
    still transformers'."""
    path, hf_model = tiny_hf_model
    system, users = conversation(np.random.default_rng(4), turns=2)
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=192, slots_per_shard=2,
             enable_prefix_caching=True, prefix_extend_below=0, warmup=False) as llm:
        loop = llm.engine.decode_loop
        admit, dropped = loop._admit, []

        def admit_after_evicting():
            if not dropped and any(i.first_page > 0 for i, _ in loop.pending):
                dropped.append(sum(a.drop_cached() for a in loop.scheduler.allocators))
            admit()

        loop._admit = admit_after_evicting
        conv = chat(llm, hf_model, system, users[:1])
        before = llm.stats()
        conv = chat(llm, hf_model, conv, users[1:])
        after = llm.stats()
        assert dropped and dropped[0] >= 2            # the prefix was cached, then was not
        assert after["prefix_skip_misses"] - before["prefix_skip_misses"] == 1
        assert after["prefix_saved_bytes"] == before["prefix_saved_bytes"]
        # The second prefill sent every page of the prompt.
        prompt = len(conv) - 6
        assert after["transfer_bytes"] - before["transfer_bytes"] == (
            -(-prompt // 16) * page_bytes(llm))
        assert after["finished"] - before["finished"] == 1 and after["aborted"] == 0
        check_pool(llm)


@pytest.mark.slow
def test_penalties_and_logprobs_through_the_cache_equal_the_uncached_path(tiny_hf_model):
    path, _ = tiny_hf_model
    system, users = conversation(np.random.default_rng(4), turns=3)
    params = dict(repetition_penalty=1.3, presence_penalty=0.4, logprobs=3)

    def run(cache, **kw):
        with LLM(path, mesh="prefill=1,decode=1", max_model_len=192, slots_per_shard=2,
                 enable_prefix_caching=cache, **kw, warmup=False) as llm:
            conv, answers = list(system), []
            for user in users:
                conv += user
                out = llm.generate(prompt_token_ids=[conv],
                                   sampling_params=greedy(8, **params))[0]
                answers.append((out.token_ids, [lp[0] for lp in out.logprobs]))
                conv += out.token_ids
            if cache:
                assert llm.stats()["prefix_hit_tokens"] > 0
                check_pool(llm)
            return answers

    # Later turns prefilled with context on the decode mesh, then on the prefill mesh
    # (whose cache a penalised request does not read: it computes its whole prompt).
    plain = run(False)
    for cached in (run(True), run(True, prefix_extend_below=0)):
        for (ids_c, lp_c), (ids_p, lp_p) in zip(cached, plain):
            assert ids_c == ids_p
            np.testing.assert_allclose(lp_c, lp_p, atol=1e-4)


# ---- across processes' interfaces: the router's prefix-aware routing -----------------

def _empty_advert(seq=1):
    return {"root": ROOT, "seq": seq, "full": True, "add": [], "drop": []}


def test_prefix_index_records_per_worker_and_forgets_a_dropped_one():
    """Beliefs per worker, bounded; none about a worker that never advertised (its
    cache is off: the router routes to it by load alone)."""
    from jaxpd.serving.prefix_index import PrefixIndex
    index = PrefixIndex(page_size=4, max_pages=3)
    ids = list(range(3, 23))                              # 5 full pages
    query = index.query(ids)
    index.record("a", ids[:12])
    assert index.cached_tokens("a", query) == 0           # no cache advertised
    for worker in ("a", "b"):
        assert index.advertise(worker, _empty_advert())
    index.record("a", ids[:12])
    assert index.cached_tokens("a", query) == 12 and index.cached_tokens("b", query) == 0
    index.record("a", ids)                                # bounded: the oldest pages go
    assert index.cached_tokens("a", query) == 0           # page 0 forgotten: no prefix
    index.record("b", ids[:8])
    index.forget("b")
    assert index.cached_tokens("b", query) == 0


def test_a_workers_journal_advertises_its_publishes_and_evictions_as_changes():
    """`CacheJournal`: a full list first, then only what changed; a page held by two
    allocators is dropped only when both evict it; `resync` sends everything again."""
    from jaxpd.engine.scheduling.page_allocator import CacheJournal
    journal = CacheJournal(ROOT)
    allocs = [PageAllocator(4, journal), PageAllocator(4, journal)]
    hashes = page_hashes(list(range(12)), 4, ROOT)        # 3 pages
    first = journal.take()
    assert first == {"root": ROOT, "seq": 1, "full": True, "add": [], "drop": []}
    for alloc in allocs:
        pages = alloc.allocate(2)
        alloc.publish(pages[0], hashes[0])
        alloc.publish(pages[1], hashes[1])
        alloc.free(pages)
    keys = [h[:8] for h in hashes]
    msg = journal.take()
    assert (msg["seq"], msg["full"], sorted(msg["add"]), msg["drop"]) == (
        2, False, sorted(keys[:2]), [])
    allocs[0].drop_cached()                               # the other still holds both
    assert journal.take()["drop"] == []
    allocs[1].drop_cached()
    assert sorted(journal.take()["drop"]) == sorted(keys[:2])
    pages = allocs[0].allocate(1)
    allocs[0].publish(pages[0], hashes[2])
    journal.resync()
    msg = journal.take()
    assert msg["full"] and msg["add"] == [keys[2]] and msg["seq"] == 5


def test_a_journal_advertisement_is_bounded(monkeypatch):
    """More held keys than one advertisement carries: a full one lists `ADVERTISED_MAX`
    of them; more changes than that since the last one make the next one full."""
    from jaxpd.engine.scheduling import page_allocator
    monkeypatch.setattr(page_allocator, "ADVERTISED_MAX", 2)
    journal = page_allocator.CacheJournal(ROOT)
    alloc = PageAllocator(8, journal)
    pages = alloc.allocate(3)
    for p, h in zip(pages, page_hashes(list(range(12)), 4, ROOT)):
        alloc.publish(p, h)
    first = journal.take()
    assert first["full"] and len(first["add"]) == 2
    alloc.free(pages)
    alloc.drop_cached()                                   # 3 changes > 2
    msg = journal.take()
    assert msg["full"] and msg["add"] == [] and msg["drop"] == []


def test_prefix_index_applies_advertisements_in_order_and_expires_beliefs():
    """The router's view of a worker: advertised changes applied in sequence (a gap
    asks for everything), a relayed belief kept until two advertisements have had
    their say, and a malformed advertisement refused naming its field."""
    from jaxpd.serving.prefix_index import PrefixIndex
    index = PrefixIndex(page_size=4)
    ids = list(range(3, 23))                              # 5 full pages
    query = index.query(ids)
    keys = [h[:8] for h in page_hashes(ids, 4, ROOT)]

    def advert(seq, full=False, add=(), drop=()):
        return {"root": ROOT, "seq": seq, "full": full, "add": list(add), "drop": list(drop)}

    assert index.advertise("w", advert(1, full=True, add=keys[:2]))
    assert index.cached_tokens("w", query) == 8
    assert index.advertise("w", advert(2, add=keys[2:4]))
    assert index.cached_tokens("w", query) == 16
    assert index.advertise("w", advert(3, drop=keys[1:2]))          # page 1 evicted
    assert index.cached_tokens("w", query) == 4
    assert not index.advertise("w", advert(5, add=keys[1:2]))       # 4 was missed
    assert not index.advertise("w", advert(6, add=keys[1:2]))       # until a full one
    assert index.cached_tokens("w", query) == 4
    assert index.advertise("w", advert(7, full=True, add=keys[:3]))
    assert index.cached_tokens("w", query) == 12
    index.record("w", ids)                                # relayed: all 5 pages, at once
    assert index.cached_tokens("w", query) == 20
    assert index.advertise("w", advert(8))
    assert index.cached_tokens("w", query) == 20          # one advertisement: kept
    assert index.advertise("w", advert(9))
    assert index.cached_tokens("w", query) == 12          # two, silent on them: gone
    for bad, field in [("x", "prefix must be a map"), ({**advert(10), "root": "r"}, "prefix.root"),
                       ({**advert(10), "seq": 0}, "prefix.seq"),
                       ({**advert(10), "full": 1}, "prefix.full"),
                       ({**advert(10), "add": [b"short"]}, "prefix.add"),
                       ({**advert(10), "drop": None}, "prefix.drop")]:
        with pytest.raises(ValueError, match=field):
            index.advertise("w", bad)
    assert index.cached_tokens("w", query) == 12          # nothing applied


def test_router_prefers_the_prefill_worker_holding_the_prompt_unless_it_is_busier():
    """`RequestFlow.prefill_order`: tokens to compute (all but the prefix a worker is
    believed to hold) plus its queue in requests of this length."""
    from jaxpd.serving.prefix_index import PrefixIndex
    from jaxpd.serving.router import RouterConfig
    from jaxpd.serving.router_flow import RequestFlow
    from jaxpd.serving.worker_pool import Worker

    class Pool:          # the one WorkerPool method prefill_order asks
        def __init__(self, workers):
            self.workers = workers

        def live(self, role, exclude=(), model=None):
            return list(self.workers)

    a, b = (Worker("prefill", name, None, static=True) for name in ("a", "b"))
    decoder = Worker("decode", "d", None, static=True)
    decoder.info = types.SimpleNamespace(model="m")
    flow = RequestFlow(Pool([a, b]), RouterConfig(), None, PrefixIndex(16), 100, None)
    ids = list(range(3, 83))                               # 80 tokens, 5 pages
    r = Request("r", ids, SamplingParams(max_tokens=1))
    query = flow.prefix.query(ids)
    assert flow.prefill_order(r, decoder, query) == [a, b]         # nothing cached: in order
    flow.prefix.record("b", ids[:48])                      # b holds 3 pages of it ...
    assert flow.prefill_order(r, decoder, query) == [a, b]         # ... but has no cache on
    for worker in ("a", "b"):
        assert flow.prefix.advertise(worker, _empty_advert())
    flow.prefix.record("b", ids[:48])                      # with its cache on
    assert flow.prefill_order(r, decoder, query) == [b, a]
    b.load["queue"] = 1                                    # ... but has one queued
    assert flow.prefill_order(r, decoder, query) == [a, b]
    assert flow.prefill_order(r, decoder, None) == [a, b]          # no prefix routing: by load


@pytest.mark.slow
def test_router_sends_each_turn_to_the_decode_worker_holding_the_conversation(tiny_hf_model):
    """A prefill worker and two decode workers with prefix caching behind a router with
    prefix routing: turn N+1 goes to the worker that served turn N. Turn 2's uncached
    rest (15 tokens) is below the threshold: that worker prefills it itself; turn 3's
    (28) is above: the prefill worker computes it and its handoff leaves out the 4
    pages that worker holds. (No conversation length is a multiple of the page size, so
    whether a finished slot wrote its last token's KV changes no page count.) Outputs
    equal transformers'. The workers' heartbeats advertise what their caches hold, and
    an eviction reaches the router's index."""
    from jaxpd.auth import InternalAuth
    from jaxpd.serving.router import Router, RouterConfig
    path, hf_model = tiny_hf_model
    auth = InternalAuth(token="t" * 32)
    workers = []
    router = Router(path, RouterConfig(max_model_len=192, heartbeat_s=1.0, prefix_routing=True,
                                       prefix_extend_below=20), auth=auth)
    try:
        address = f"127.0.0.1:{router.listen('127.0.0.1', 0)}"
        start_workers(workers, path, address, auth, ["prefill", "decode", "decode"])
        deadline = time.monotonic() + 30
        while len(router.live_workers()) < 3:
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.05)
        system, users = conversation(np.random.default_rng(5), turns=3, system_len=38)
        conv = chat(router, hf_model, system, users)
        counts = router.counters.snapshot()
        assert counts["prefix_routed"] == 1 and counts["decode_prefills"] == 0
        decoders = sorted(workers[1:], key=lambda w: w[0].stats()["prefix_hit_tokens"])
        assert decoders[0][0].stats()["prefix_hit_tokens"] == 0    # one held the whole chat
        holder, holder_server, _ = decoders[1]
        held = holder.stats()
        assert held["transfers"] == 2 and held["prefix_skip_misses"] == 0
        assert held["prefix_saved_bytes"] == 4 * page_bytes(workers[0][0])
        for llm, _, _ in workers[1:]:
            check_pool(llm)
        # What the workers advertise with their heartbeats: the holder's cache holds
        # the whole chat but its last token; the prefill worker's, the last prompt.
        index, query = router.prefix, router.prefix.query(conv)

        def advertised(server, llm, ids):
            keys = {h[:8] for h in page_hashes(ids, 16, llm.engine.prefix_root)}
            return keys <= index._held[server.address].advertised

        prefill_llm, prefill_server, _ = workers[0]
        deadline = time.monotonic() + 10
        while not (advertised(holder_server, holder, conv[:-1]) and
                   advertised(prefill_server, prefill_llm, conv[:-6])):
            assert time.monotonic() < deadline, "the caches were not advertised"
            time.sleep(0.05)
        # An eviction reaches the router within heartbeats: it stops believing.
        assert index.cached_tokens(holder_server.address, query) >= (len(conv) - 1) // 16 * 16
        for a in holder.engine.decode_scheduler.allocators:       # (idle: no other user)
            a.drop_cached()
        while index.cached_tokens(holder_server.address, query):
            assert time.monotonic() < deadline, "the eviction was not advertised"
            time.sleep(0.05)
    finally:
        router.shutdown()
        for llm, server, _ in workers:
            server.stop(0)
            llm.shutdown()


# Colocated, the decode mesh's prefill with context is its only prefill: all warmed up.
@pytest.mark.slow
def test_warmup_covers_every_prefill_with_context_a_colocated_chat_needs(tiny_hf_model):
    """No compile in steady state with the cache on: concurrent chats (hits of every
    width) run only programs warm-up compiled."""
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(6)
    chats = [conversation(rng, turns=2, system_len=70) for _ in range(3)]
    with LLM(path, mesh="colocated=1", max_model_len=128, page_size=8, slots_per_shard=3,
             max_prefill_batch=1, enable_prefix_caching=True, warmup=True) as llm:
        compiled = llm.engine.counter.counts()
        chats_at_once(llm, hf_model, chats)
        assert llm.stats()["prefix_hit_tokens"] > 0
        after = llm.engine.counter.counts()
        for program in ("extend", "decode"):
            assert after[program] == compiled[program], program
        check_pool(llm)


def test_closing_a_background_compiler_waits_for_the_compile_in_progress():
    import threading

    from jaxpd.engine.compile.background import BackgroundCompiler
    from jaxpd.engine.programs.decode_runner import CompileCounter
    started, release = threading.Event(), threading.Event()

    class Lowered:                       # what `lower()` returns: compiled on the thread
        def compile(self):
            started.set()
            release.wait(10)
            return "program"

    compiler = BackgroundCompiler("probe", CompileCounter())
    assert not compiler.ready("k", Lowered) and started.wait(10)
    assert compiler.pending == 1
    closing = threading.Thread(target=compiler.close)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()            # waits for the compile in progress ...
    release.set()
    closing.join(10)
    assert not closing.is_alive() and compiler.get("k") == "program"   # ... which lands


def test_a_program_a_batch_asks_for_compiles_before_those_anticipated():
    import threading

    from jaxpd.engine.compile.background import BackgroundCompiler
    from jaxpd.engine.programs.decode_runner import CompileCounter
    order, release = [], threading.Event()

    def lowered(key):
        class Lowered:
            def compile(self):
                if key == "first":
                    release.wait(10)        # holds the thread while the rest queue
                order.append(key)
                return key
        return Lowered

    compiler = BackgroundCompiler("probe", CompileCounter())
    compiler.request("first", lowered("first"))
    for key in ("a", "b", "c"):
        compiler.anticipate(key, lowered(key))
    compiler.request("d", lowered("d"))
    compiler.request("c", lowered("c"))     # anticipated, now asked for: moves ahead
    compiler.anticipate("d", lowered("d"))  # asked for already: stays ahead
    assert compiler.pending == 5
    release.set()
    deadline = time.monotonic() + 10
    while compiler.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["first", "d", "c", "a", "b"]
    assert compiler.counter.counts() == {"probe": 5}
    compiler.close()


class _PrimingRunner:
    """`DecodeRunner`'s priming side, plain Python: `unprimed` compiled programs that
    never ran, `asked` those a request asked to run once, `primed` the runs."""

    def __init__(self, unprimed):
        self.unprimed, self.asked, self.primed = list(unprimed), set(), []

    def unprimed_extends(self, ask=False):
        return sorted(self.unprimed, key=lambda shape: shape not in self.asked)

    def prime_asked(self, *shape):
        return shape in self.asked

    def prime_extend(self, *shape):
        self.unprimed.remove(shape)
        self.primed.append(shape)


def test_a_program_compiled_in_the_background_runs_once_before_a_request_does():
    """The extend loop runs each background-compiled program once on its own (its
    first run is the slow one) when it has no call to make: one a request asked for at
    once, any other only while no slot decodes, so streams are not delayed for a
    program no request needs."""
    import queue as queue_mod
    from jaxpd.engine.loops.extend_loop import ExtendLoop
    from jaxpd.sampling_params import SamplingParams
    from jaxpd.stats import StatsCounter

    sched = DecodeScheduler(1, 2, 17, 4, prefix_root=ROOT)
    runner = _PrimingRunner([(1, 4, 4), (1, 8, 4)])
    loop = ExtendLoop(runner, sched, queue_mod.SimpleQueue(), StatsCounter(), buckets=[4, 8],
                      max_batch=2, max_tokens=64, max_pages_per_slot=8, context_step=4,
                      expected_below=8, expects_fresh=False, reroute=lambda r: None)
    decoding = Request("decoding", list(range(10, 15)), SamplingParams(max_tokens=4))
    slot, shared = sched.find_slot(decoding.num_tokens, decoding.prefill_ids)
    sched.admit(slot, decoding, decoding.num_tokens, ready=True, shared=shared)
    assert loop.run_once() == [] and runner.primed == []      # a stream runs: not asked
    runner.asked.add((1, 8, 4))
    assert loop.run_once() == [] and runner.primed == [(1, 8, 4)]
    sched.release(slot)
    assert loop.run_once() == [] and runner.primed == [(1, 8, 4), (1, 4, 4)]
    assert loop.run_once() == [] and runner.unprimed == []


# Beside a prefill mesh, programs with a prefix compile after warm-up, on demand.
@pytest.mark.slow
@pytest.mark.parametrize("extend_below", [0, 256])
def test_programs_with_a_prefix_compile_in_the_background_after_warmup(tiny_hf_model,
                                                                       extend_below):
    """`prefill=1,decode=1`, warmed up: no program with a prefix is compiled before
    serving. A follow-up turn whose program is not ready runs the cache-off way
    meanwhile -- on the prefill mesh without its prefix (`extend_below` 0: every turn
    through the prefill mesh), or through the prefill mesh instead of the decode mesh's
    prefill with context (256) -- and asks for it in the background; the same kind of
    turn in the next chat, once it is compiled, uses it. Same greedy tokens as
    transformers throughout, and nothing compiles on a serving thread. The narrowest
    programs of a prefix of at most a quarter of the context are compiled right after
    warm-up, before any turn asks (`likely_prefix_shapes`): such a turn's first repeat
    pays."""
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(12)
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=128, page_size=8,
             slots_per_shard=2, max_prefill_batch=1, enable_prefix_caching=True,
             prefix_extend_below=extend_below, warmup=True) as llm:
        compiled = llm.engine.counter.counts()
        assert "extend" not in compiled
        anticipated, _ = likely_prefix_shapes(llm.engine)
        assert anticipated and all(w * 8 <= 32 for _, _, w in anticipated), anticipated
        assert settle(llm.engine, 120) == {}
        cache = llm.engine.prefill_cache
        assert all(cache.compiler.get(((b, t), (b, w))) is not None
                   for b, t, w in anticipated)
        if extend_below == 0:     # a repeat within a quarter of the context: a hit at once
            short = rng.integers(3, 256, 24).tolist()
            before = llm.stats()
            with XlaCompiles(on_request_threads=True) as xla:
                for prompt in (short, short + rng.integers(3, 256, 6).tolist()):
                    out = llm.generate(prompt_token_ids=[prompt],
                                       sampling_params=SamplingParams(max_tokens=4,
                                                                      temperature=0))
                    assert out[0].token_ids == hf_greedy(hf_model, prompt, 4)
            after = llm.stats()
            assert after["prefill_cache_hit_tokens"] - before["prefill_cache_hit_tokens"] == 24
            assert after["prefill_cache_cold_batches"] == before["prefill_cache_cold_batches"]
            assert xla.count == 0 and cache.compiler.pending == 0
        seen = []
        for _ in range(2):
            before = llm.stats()
            chat(llm, hf_model, *conversation(rng, turns=2, system_len=70))
            after = llm.stats()
            seen.append({k: after[k] - before[k] for k in (
                "prefill_cache_cold_batches", "prefill_cache_hit_tokens", "local_prefills")})
            assert settle(llm.engine, 120) == {}
        if extend_below == 0:     # the prefill mesh: cold, then its prefix pays
            assert seen[0]["prefill_cache_cold_batches"] == 1, seen
            assert seen[0]["prefill_cache_hit_tokens"] == 0, seen
            assert seen[1]["prefill_cache_cold_batches"] == 0, seen
            assert seen[1]["prefill_cache_hit_tokens"] > 0, seen
        else:                     # the decode mesh: the prefill mesh, then its own
            assert [s["local_prefills"] for s in seen] == [0, 1], seen
            # Settled: each program compiled in the background ran once, before a
            # request could (the second chat's turn ran a program that had run).
            assert llm.engine.decode_runner.unprimed_extends() == []
        after = llm.engine.counter.counts()
        for program in ("prefill_cached", "decode"):
            assert after[program] == compiled[program], program
        assert "extend" not in after
        assert after.get("prefill_cached_background", 0) + after.get("extend_background", 0) > 0
        check_pool(llm)
