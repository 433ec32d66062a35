"""The host KV tier: a bounded host store of evicted prefix pages (LRU by bytes, a
checksum per page), and an engine whose tiny pool evicts a conversation that comes
back restored from it -- against transformers, with the page accounting and the
compile count checked."""
import types

import numpy as np
import pytest

from jaxpd import LLM
from jaxpd.engine.kv.host_store import HostStore
from tests.hf_fixtures import hf_greedy
from tests.support.prefix_chats import check_pool, greedy

PAGE = 16


def _page(value: float, shape=(2, 4, 2, 3)):
    return np.full(shape, value, np.float32), np.full(shape, -value, np.float32)


# ---- the store (plain Python) ------------------------------------------------------

def test_host_tier_store_is_lru_by_bytes_and_bounded():
    page_bytes = sum(a.nbytes for a in _page(0))
    store = HostStore(3 * page_bytes + page_bytes // 2)      # room for three pages
    for i in range(3):
        assert store.put(bytes([i]), *_page(i))
    assert store.prefix([b"\0", b"\1", b"\2", b"\3"]) == 3
    assert store.touch(b"\0")                                # now the most recent
    assert store.put(b"\3", *_page(3))                       # evicts the oldest: page 1
    assert b"\1" not in store and all(bytes([i]) in store for i in (0, 2, 3))
    assert store.num_evicted == 1 and store.num_bytes == 3 * page_bytes
    assert store.prefix([b"\0", b"\1", b"\2"]) == 1          # a run stops at a gap
    # Held pages are only touched, and the caller's arrays stay the caller's.
    k, v = _page(9)
    assert store.put(b"\3", k, v) and store.num_stored == 4
    k2, v2 = _page(5)
    store.put(b"\5", k2, v2)
    k2 += 1
    [(k_out, _)] = store.take([b"\5"])
    assert (k_out == 5).all()
    # A page larger than the whole store is not kept; nothing else is disturbed.
    assert not store.put(b"big", *_page(0, shape=(64, 4, 2, 3)))
    assert len(store) == 3
    store.check()
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostStore(-1)


def test_host_tier_store_refuses_a_corrupted_page():
    store = HostStore(1 << 20)
    for i in range(3):
        store.put(bytes([i]), *_page(i))
    k, _ = store.take([b"\1"])[0]
    k[0, 0, 0, 0] += 1.0                                     # bytes change under it
    pages = store.take([b"\0", b"\1", b"\2"])
    assert len(pages) == 1 and (pages[0][0] == 0).all()     # the run ends at the bad one
    assert store.num_corrupt == 1 and b"\1" not in store    # dropped, counted
    assert store.prefix([b"\0", b"\1"]) == 1
    store.check()


# ---- the engine, against transformers ----------------------------------------------

@pytest.fixture(scope="module")
def host_llm(tiny_hf_model):
    """A colocated engine whose pool holds one request (4 pages of 16 tokens and the
    null page), with the host tier on, warmed up; and its compile counts then. Its
    offloads land in pinned host memory, as on an accelerator (CPU devices have that
    memory kind too; the engine keeps it for other backends)."""
    from jaxpd.engine.programs import decode_runner
    path, _ = tiny_hf_model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_runner, "host_memory_kind", lambda mesh: "pinned_host")
        llm = LLM(path, mesh="colocated=1", max_model_len=64, slots_per_shard=1,
                  max_prefill_batch=1, pages_per_shard=5, enable_prefix_caching=True,
                  kv_host_cache_gb=0.001, warmup=True)
    with llm:
        yield llm, llm.engine.counter.counts()


def _evicted_conversation(llm, hf_model, rng):
    """A first turn (33 tokens: two full pages once answered), then two strangers of 40
    tokens that need the pool: the turn's pages leave it for the host tier. Returns the
    second turn's prompt."""
    first = rng.integers(3, 256, 33).tolist()
    out = llm.generate(prompt_token_ids=[first], sampling_params=greedy(6))[0]
    assert out.token_ids == hf_greedy(hf_model, first, 6)
    for _ in range(2):
        stranger = rng.integers(3, 256, 40).tolist()
        llm.generate(prompt_token_ids=[stranger], sampling_params=greedy(4))
    conv = first + out.token_ids + rng.integers(3, 256, 9).tolist()
    hashes = llm.engine.decode_scheduler.hashes(conv)[:2]
    assert not any(a.cached_prefix(hashes) for a in llm.engine.decode_scheduler.allocators)
    assert llm.engine.host_tier.restorable(hashes) == 2
    return conv, hashes


def _delta(llm, before, *names):
    after = llm.stats()
    return {n: after[n] - before[n] for n in names}


COUNTED = ("prefill_tokens", "prefix_hit_tokens", "prefix_host_hit_tokens",
           "host_tier_restored_pages", "host_tier_corrupt_pages")


@pytest.mark.slow
def test_host_tier_restores_an_evicted_conversation_token_identically(host_llm, tiny_hf_model):
    llm, compiled = host_llm
    _, hf_model = tiny_hf_model
    conv, _ = _evicted_conversation(llm, hf_model, np.random.default_rng(0))
    before = llm.stats()
    out = llm.generate(prompt_token_ids=[conv], sampling_params=greedy(6))[0]
    assert out.token_ids == hf_greedy(hf_model, conv, 6)
    d = _delta(llm, before, *COUNTED)
    # Both full pages came back from the host; only the rest was computed.
    assert d == {"prefill_tokens": len(conv) - 2 * PAGE, "prefix_hit_tokens": 0,
                 "prefix_host_hit_tokens": 2 * PAGE, "host_tier_restored_pages": 2,
                 "host_tier_corrupt_pages": 0}, d
    stats = llm.stats()
    assert stats["host_tier_stored_pages"] >= 2 and stats["host_tier_pages"] >= 2
    assert 0 < stats["host_tier_bytes"] <= 0.001 * 2**30
    # Nothing compiled while serving: offloads and restores ran warmed-up programs.
    after = llm.engine.counter.counts()
    for program in ("offload", "insert", "extend", "decode"):
        assert after.get(program) == compiled.get(program), program
    assert compiled.get("offload") == len(llm.engine.host_tier.sizes())
    k, _ = llm.engine.decode_runner.offload(0, [0])          # a warmed-up size
    assert k.sharding.memory_kind == "pinned_host"
    check_pool(llm)
    llm.engine.host_tier.store.check()


@pytest.mark.slow
def test_host_tier_refuses_a_corrupted_page_and_still_answers(host_llm, tiny_hf_model):
    llm, _ = host_llm
    _, hf_model = tiny_hf_model
    conv, hashes = _evicted_conversation(llm, hf_model, np.random.default_rng(1))
    k, _ = llm.engine.host_tier.store.take(hashes[1:])[0]
    k.reshape(-1)[0] += 1.0                                  # the second page's bytes rot
    before = llm.stats()
    out = llm.generate(prompt_token_ids=[conv], sampling_params=greedy(6))[0]
    assert out.token_ids == hf_greedy(hf_model, conv, 6)
    d = _delta(llm, before, *COUNTED)
    assert d == {"prefill_tokens": len(conv) - PAGE, "prefix_hit_tokens": 0,
                 "prefix_host_hit_tokens": PAGE, "host_tier_restored_pages": 1,
                 "host_tier_corrupt_pages": 1}, d
    assert hashes[1] not in llm.engine.host_tier.store
    check_pool(llm)


@pytest.mark.slow
def test_host_tier_aborts_around_restores_leak_no_page(host_llm, tiny_hf_model):
    """Turns restored from the host tier, one aborted at once, two at a time on a pool
    that holds one: every page and slot comes back, the store within its bound."""
    llm, _ = host_llm
    _, hf_model = tiny_hf_model
    rng = np.random.default_rng(2)
    convs = [_evicted_conversation(llm, hf_model, rng)[0] for _ in range(2)]
    reqs = [llm.submit(llm.make_request(prompt_token_ids=c, sampling_params=greedy(8)))
            for c in convs]
    llm.abort(reqs[0].request_id)
    outs = [llm._wait(r) for r in reqs]
    assert outs[0].finish_reason == "abort"
    assert outs[1].token_ids == hf_greedy(hf_model, convs[1], 8)
    check_pool(llm)
    llm.engine.host_tier.store.check()


def test_host_tier_needs_prefix_caching_and_a_decode_pool():
    from jaxpd.config import EngineConfig
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        EngineConfig(mesh="colocated=1", enable_prefix_caching=False, kv_host_cache_gb=1.0)
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        EngineConfig(mesh="prefill=1", enable_prefix_caching=True, kv_host_cache_gb=1.0)
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        EngineConfig(mesh="colocated=1", enable_prefix_caching=True,
                     kv_host_cache_gb=float("nan"))
    assert EngineConfig(mesh="colocated=1", enable_prefix_caching=True,
                        kv_host_cache_gb=0.5).kv_host_cache_gb == 0.5


# ---- what a worker advertises, and how the router weighs it ------------------------

ROOT = b"host-tier-root"


def test_host_tier_pages_are_advertised_and_scored_apart_from_the_pool():
    """A worker's journal lists the pages its host tier holds apart ("host_add",
    "host_drop"); the router's index counts them as restorable, never as held (a
    handoff may leave out only pool pages), and picks the decode worker that can
    restore the longest prefix, its pool's pages breaking ties."""
    from jaxpd.engine.scheduling.page_allocator import CacheJournal, PageAllocator, page_hashes
    from jaxpd.serving.prefix_index import PrefixIndex
    from jaxpd.serving.router import RouterConfig
    from jaxpd.serving.router_flow import RequestFlow
    from jaxpd.serving.worker_pool import Worker

    ids = list(range(3, 83))                               # 80 tokens, 5 pages of 16
    hashes = page_hashes(ids, 16, ROOT)
    keys = [h[:8] for h in hashes]
    journal = CacheJournal(ROOT)
    alloc = PageAllocator(8, journal)
    store = HostStore(2 * sum(a.nbytes for a in _page(0)), journal)
    pages = alloc.allocate(2)
    for p, h in zip(pages, hashes[:2]):
        alloc.publish(p, h)
    store.put(hashes[2], *_page(2))
    store.put(hashes[3], *_page(3))
    first = journal.take()
    assert first["full"] and sorted(first["add"]) == sorted(keys[:2])
    assert sorted(first["host_add"]) == sorted(keys[2:4])
    store.put(hashes[4], *_page(4))                        # evicts page 2 from the store
    change = journal.take()
    assert change["host_add"] == [keys[4]] and change["host_drop"] == [keys[2]]
    assert "host_add" not in journal.take()                # nothing changed: absent

    index = PrefixIndex(16)
    query = index.query(ids)
    assert index.advertise("d1", first)
    assert index.cached_tokens("d1", query) == 32 and index.restorable_tokens("d1", query) == 64
    assert index.advertise("d1", change)                   # page 2 gone: the run stops
    assert index.restorable_tokens("d1", query) == 32
    with pytest.raises(ValueError, match="prefix.host_add"):
        index.advertise("d1", {**change, "seq": 3, "host_add": [b"short"]})

    class Pool:
        def live(self, role, exclude=(), model=None):
            return []

    d1, d2 = (Worker("decode", name, None, static=True) for name in ("d1", "d2"))
    for w in (d1, d2):
        w.load["free_slots"] = 1
    flow = RequestFlow(Pool(), RouterConfig(), None, PrefixIndex(16), 100, None)
    flow.prefix.advertise("d1", {"root": ROOT, "seq": 1, "full": True, "add": keys[:2],
                                 "drop": []})
    flow.prefix.advertise("d2", {"root": ROOT, "seq": 1, "full": True, "add": keys[:1],
                                 "drop": [], "host_add": keys[1:4]})
    assert flow.choose_decoder([d1, d2], query) == (d2, 16, 64)    # restores the most
    flow.prefix.advertise("d1", {"root": ROOT, "seq": 2, "full": False, "add": [],
                                 "drop": [], "host_add": keys[2:4]})
    assert flow.choose_decoder([d1, d2], query) == (d1, 32, 64)    # as far; more in its pool
    assert flow.choose_decoder([d1, d2], None)[1:] == (0, 0)


def test_host_tier_counts_are_exported_to_prometheus():
    from jaxpd.stats import exported
    names = {metric for _, metric, _, _ in exported()}
    assert {"jaxpd_prefix_host_hit_tokens_total", "jaxpd_prefix_hit_tokens_total",
            "jaxpd_host_tier_restored_pages_total", "jaxpd_host_tier_corrupt_pages_total",
            "jaxpd_host_tier_stored_pages_total", "jaxpd_host_tier_pages",
            "jaxpd_host_tier_bytes", "jaxpd_host_tier_evicted_pages_total"} <= names
    # The prefill mesh's tier alike: what it holds, its hits, what it dropped.
    assert {"jaxpd_prefill_host_tier_pages", "jaxpd_prefill_host_tier_bytes",
            "jaxpd_prefill_cache_host_hit_tokens_total",
            "jaxpd_prefill_host_tier_restored_pages_total",
            "jaxpd_prefill_host_tier_stored_pages_total",
            "jaxpd_prefill_host_tier_evicted_pages_total"} <= names


def test_prefill_host_tier_pages_are_scored_apart_from_the_pool():
    """The router ranks prefill workers by the tokens each would compute, counting the
    pages its host tier advertises as restorable (never as held), its pool's pages
    breaking ties, then its queue."""
    from jaxpd.engine.scheduling.page_allocator import page_hashes
    from jaxpd.serving.prefix_index import PrefixIndex
    from jaxpd.serving.router import RouterConfig
    from jaxpd.serving.router_flow import RequestFlow
    from jaxpd.serving.worker_pool import Worker
    from jaxpd.request import Request
    from jaxpd.sampling_params import SamplingParams

    ids = list(range(3, 83))                               # 80 tokens, 5 pages of 16
    keys = [h[:8] for h in page_hashes(ids, 16, ROOT)]
    p1, p2, p3 = (Worker("prefill", name, None, static=True) for name in ("p1", "p2", "p3"))
    for w in (p1, p2, p3):
        w.load["queue"] = 0

    class Pool:
        def live(self, role, exclude=(), model=None):
            return [p1, p2, p3]

    flow = RequestFlow(Pool(), RouterConfig(), None, PrefixIndex(16), 100, None)
    advertise = lambda w, add, host: flow.prefix.advertise(w.address, {  # noqa: E731
        "root": ROOT, "seq": 1, "full": True, "add": add, "drop": [], "host_add": host})
    advertise(p1, keys[:2], [])
    advertise(p2, keys[:1], keys[1:4])
    advertise(p3, [], [])
    r = Request("r", ids, SamplingParams(max_tokens=4))
    query = flow.prefix.query(ids)
    decoder = types.SimpleNamespace(info=types.SimpleNamespace(model="m"))
    assert flow.prefill_order(r, decoder, query) == [p2, p1, p3]   # p2 computes the least
    advertise(p1, keys[:2], keys[2:4])                     # as far, more in its pool
    assert flow.prefill_order(r, decoder, query) == [p1, p2, p3]
    p1.load["queue"] = 1                                   # a queued request outweighs it
    assert flow.prefill_order(r, decoder, query) == [p2, p3, p1]


# ---- the prefill mesh's own cache -----------------------------------------------------

@pytest.mark.slow
def test_prefill_host_tier_restores_an_evicted_prompt_prefix(tiny_hf_model):
    """The prefill mesh's cache (4 pages) evicts a first turn's prompt pages for two
    strangers; its host tier keeps them, and the next turn gets them back instead of
    computing them: only the rest is computed (counted), the answer equals
    transformers', and both pools' books balance."""
    path, hf_model = tiny_hf_model
    rng = np.random.default_rng(3)
    with LLM(path, mesh="prefill=1,decode=1", max_model_len=64, slots_per_shard=1,
             max_prefill_batch=1, pages_per_shard=5, prefill_cache_pages=5,
             enable_prefix_caching=True, prefix_extend_below=0, prefill_host_cache_gb=0.001,
             warmup=False) as llm:
        first = rng.integers(3, 256, 33).tolist()
        out = llm.generate(prompt_token_ids=[first], sampling_params=greedy(6))[0]
        assert out.token_ids == hf_greedy(hf_model, first, 6)
        for _ in range(2):
            llm.generate(prompt_token_ids=[rng.integers(3, 256, 40).tolist()],
                         sampling_params=greedy(4))
        cache = llm.engine.prefill_cache
        hashes = cache.hashes(first)[:2]
        assert not cache.allocator.cached_prefix(hashes)       # gone from the pool
        assert cache.host.restorable(hashes) == 2               # kept on the host
        conv = first + out.token_ids + rng.integers(3, 256, 9).tolist()
        before = llm.stats()
        again = llm.generate(prompt_token_ids=[conv], sampling_params=greedy(6))[0]
        assert again.token_ids == hf_greedy(hf_model, conv, 6)
        names = ("prefill_tokens", "prefill_cache_hit_tokens", "prefill_cache_host_hit_tokens",
                 "prefill_host_tier_restored_pages", "prefill_host_tier_corrupt_pages",
                 "host_tier_restored_pages")
        d = _delta(llm, before, *names)
        assert d == {"prefill_tokens": len(conv) - 2 * PAGE, "prefill_cache_hit_tokens": 0,
                     "prefill_cache_host_hit_tokens": 2 * PAGE,
                     "prefill_host_tier_restored_pages": 2,
                     "prefill_host_tier_corrupt_pages": 0, "host_tier_restored_pages": 0}, d
        stats = llm.stats()
        assert stats["prefill_host_tier_stored_pages"] >= 2
        assert cache.allocator.cached_prefix(hashes)            # restored pages published
        cache.host.store.check()
        # Its gauges, and its pages advertised apart from the pool's (a worker's
        # heartbeat): every page it holds, by key.
        store = cache.host.store
        assert stats["prefill_host_tier_pages"] == len(store) > 0
        assert stats["prefill_host_tier_bytes"] == store.num_bytes > 0
        assert stats["prefill_host_tier_evicted_pages"] == store.num_evicted
        llm.engine.cache_journal.resync()
        advertised = llm.engine.cache_journal.take()
        held = [h[:8] for h in cache.hashes(conv) + cache.hashes(first) if h in store]
        assert held and set(held) <= set(advertised["host_add"])
        check_pool(llm)
        # What ran is what warm-up compiles: one offload and one restore program per
        # padded page count.
        from jaxpd.engine.compile.warmup import serving_programs
        described = {s.describe for s in serving_programs(llm.engine)}
        for m in cache.host_sizes():
            assert f"prefill_cached page offload to the host tier for {m} pages" in described
            assert f"prefill_cached page restore for {m} pages" in described
        counts = llm.engine.counter.counts()
        assert 1 <= counts["prefill_cached_offload"] <= len(cache.host_sizes())
        assert counts["prefill_cached_insert"] == 1             # the one restore: 2 pages


# ---- the decode mesh's prefill with context beside a prefill mesh ----------------------

class _ExtendRunner:
    """`DecodeRunner`'s extend side, numpy only: `compiled` holds the (rows, length,
    width) shapes compiled in the background; `asked` what was asked for, `ran` what
    ran (each row's first token: its last prompt token + 1)."""

    def __init__(self):
        self.compiled, self.asked, self.ran = set(), [], []

    def extend_compiled(self, rows, length, width):
        return (rows, length, width) in self.compiled

    def extend_ready(self, rows, length, width):
        self.asked.append((rows, length, width))
        return self.extend_compiled(rows, length, width)

    def unprimed_extends(self, ask=False):
        return []                       # a compiled shape counts as run once here

    def extend(self, tokens, starts, lengths, prefix_tables, new_tables, row_slots, sampling):
        shape = (tokens.shape[0], tokens.shape[1], prefix_tables.shape[1])
        assert shape in self.compiled, f"{shape} would compile on the decode thread"
        self.ran.append(shape)
        last = tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)]
        return last + 1, None


def test_host_tier_routed_turn_whose_program_is_cold_goes_to_the_prefill_mesh():
    """Routing counts what the host tier could restore, and the pool can evict between
    routing and admission, so the decode mesh's prefill with context may find another
    prefix than routing saw, needing a program still compiling in the background: that
    request goes through the prefill mesh instead (counted), its program is asked for,
    nothing is compiled on the decode thread and no page stays held; a row whose
    program with the rows already in the call is not compiled waits for the next call."""
    import queue as queue_mod
    from jaxpd.engine.loops.extend_loop import ExtendLoop
    from jaxpd.engine.scheduling.scheduler import DecodeScheduler
    from jaxpd.request import Request, State
    from jaxpd.sampling_params import SamplingParams
    from jaxpd.stats import StatsCounter

    page = 4
    sched = DecodeScheduler(1, 2, 17, page, prefix_root=b"root")
    runner, inbox, stats, rerouted = _ExtendRunner(), queue_mod.SimpleQueue(), StatsCounter(), []
    loop = ExtendLoop(runner, sched, inbox, stats, buckets=[4, 8, 16, 32], max_batch=2,
                      max_tokens=64, max_pages_per_slot=8, context_step=4, expected_below=16,
                      expects_fresh=False, reroute=rerouted.append)
    system = list(range(10, 22))                           # 3 full pages
    old = Request("old", system + [50], SamplingParams(max_tokens=4))
    slot, shared = sched.find_slot(old.num_tokens, old.prefill_ids)
    sched.admit(slot, old, old.num_tokens, ready=True, shared=shared)
    sched.release(slot)                                    # its 3 pages stay cached

    def turn(rid, prompt):
        r = Request(rid, prompt, SamplingParams(max_tokens=4))
        inbox.put(r)
        return r

    # Its prefix is cached (3 pages: width 4), its rest (2 tokens) runs in bucket 4:
    # not compiled yet -> the prefill mesh, and the program is asked for.
    first = turn("first", system + [60, 61])
    assert loop.run_once() == []
    assert rerouted == [first] and first.state is State.WAITING
    assert first.kv_skip_pages == 3                        # the pool pages it may skip
    assert runner.asked == [(1, 4, 4)] and runner.ran == []
    assert stats.snapshot()["extend_cold_requests"] == 1
    assert all(s is None for s in sched.slots) and sched.allocators[0].num_used == 0

    # Once compiled, the same shape runs here, with its prefix shared.
    runner.compiled.add((1, 4, 4))
    second = turn("second", system + [70, 71])
    [(_, r, token)] = loop.run_once()
    assert r is second and token == 72 and runner.ran == [(1, 4, 4)]
    sched.release(sched.slot_of(second))

    # Two rows whose call together needs (2, 16, 4): only (1, 16, 4) is compiled, so
    # the first runs alone and the second leads the next call, alone, compiled too.
    runner.compiled |= {(1, 16, 4), (1, 4, 4)}
    third = turn("third", system + list(range(80, 90)))    # 10 new tokens: bucket 16
    fourth = turn("fourth", system + [90, 91])
    assert [r for _, r, _ in loop.run_once()] == [third]
    assert [r for _, r, _ in loop.run_once()] == [fourth]
    assert runner.ran[1:] == [(1, 16, 4), (1, 4, 4)]
    assert len(rerouted) == 1 and stats.snapshot()["extend_cold_requests"] == 1
    for s in [i for i, s in enumerate(sched.slots) if s is not None]:
        sched.release(s)
    assert sched.allocators[0].num_used == 0
