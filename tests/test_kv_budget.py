"""The KV budget (`jaxpd.kv_budget`): sizes, the default split over the pools, the
errors, the launcher's flag, and `LLM`'s budget and plan on a stand-in model config.
No engine."""
import dataclasses
import types

import pytest
from absl import flags

from jaxpd.config import EngineConfig, kv_page_bytes
from jaxpd.engine.topology import Topology
from jaxpd import host_memory
from jaxpd.kv_budget import (CPU_KV_CACHE_BYTES, CPU_KV_FRACTION, KVPlan, check_fits,
                             coarse_floor, default_budget, has_prefill_pool, num_pools,
                             parse_kv_cache_memory)

GIB = 1 << 30


@pytest.mark.parametrize("value, num", [
    ("4GiB", 4 * GIB), ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5gib", 3 * GIB // 2),
    (" 3 KB ", 3000), ("1000", 1000), ("7B", 7), (4096, 4096), (2e9, 2 * 10**9)])
def test_a_budget_is_bytes_or_a_size_with_a_unit(value, num):
    assert parse_kv_cache_memory(value) == num


@pytest.mark.parametrize("value, says", [
    (0, "must be a positive number of bytes"), (-1, "must be a positive"),
    ("0GB", "must be a positive"), ("-3GiB", "must be a positive"),
    ("0.1B", "must be a positive"), ("abc", "is not a size"), ("4G", "is not a size"),
    ("", "is not a size"), ("1e9", "is not a size"), (True, "expected a whole number"),
    (1.5, "expected a whole number"), (None, "expected a whole number")])
def test_a_bad_budget_is_refused_naming_the_field(value, says):
    with pytest.raises(ValueError, match=f"^kv_cache_memory={value!r}.*{says}"):
        parse_kv_cache_memory(value)


def _launcher(*argv):
    from jaxpd.serving import launch_flags

    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["launch", *argv])
    return launch_flags.engine_options(fv)


def test_the_launcher_flag_takes_the_same_sizes_and_says_the_same():
    assert "kv_cache_memory" not in _launcher()
    assert _launcher("--kv_cache_memory=4GiB")["kv_cache_memory"] == 4 * GIB
    assert _launcher("--kv_cache_memory", "512MiB")["kv_cache_memory"] == 512 << 20
    assert _launcher("--kv_cache_memory=2000")["kv_cache_memory"] == 2000
    assert _launcher("--kv_cache_gb=1.5")["kv_cache_memory"] == 1_500_000_000  # GB, as before
    for bad in ("0", "-2GB", "4G", "lots"):
        with pytest.raises(ValueError) as raised:
            parse_kv_cache_memory(bad)
        with pytest.raises(flags.IllegalFlagValueError) as flagged:
            _launcher(f"--kv_cache_memory={bad}")
        assert str(raised.value) in str(flagged.value)
    with pytest.raises(flags.IllegalFlagValueError, match="not both"):
        _launcher("--kv_cache_memory=1GiB", "--kv_cache_gb=1")


def test_available_memory_comes_from_meminfo_else_free_pages(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683772 kB\nMemFree:  100 kB\n"
                       "MemAvailable:   20000000 kB\n")
    assert host_memory.available_bytes(str(meminfo)) == 20000000 * 1024
    fallback = host_memory.available_bytes(str(tmp_path / "absent"))
    assert fallback is None or fallback > 0
    assert host_memory.available_bytes() > 0                # this host's /proc/meminfo
    status = tmp_path / "status"
    status.write_text("Name: python\nVmRSS:\t  123456 kB\n")
    assert host_memory.rss_bytes(str(status)) == 123456 * 1024
    assert host_memory.rss_bytes(str(tmp_path / "absent")) is None
    host_memory.give_back()                                  # safe with nothing to give


@pytest.mark.parametrize("mesh, options", [
    ("prefill=1,decode=1", {}), ("prefill=2,decode=2", {}), ("prefill=2,decode=2x2", {}),
    ("prefill=1,decode=1", {"enable_prefix_caching": False}),
    ("prefill=1,decode=3", {"layerwise_min_tokens": 64}),
    ("prefill=1,decode=1", {"kv_transfer_dtype": "int8"}),
    ("colocated=4", {}), ("colocated=2", {"enable_prefix_caching": True}),
    ("decode=2", {}), ("prefill=2", {}), ("elastic=4", {})])
def test_the_pools_counted_are_the_pools_the_engine_builds(mesh, options):
    """`has_prefill_pool` predicts `Topology.paged_prefill` from the options alone (before
    the context, hence the config, is known)."""
    config = EngineConfig(mesh=mesh, max_model_len=256, **options)
    topology = Topology.of(config)
    spec = config.mesh
    assert has_prefill_pool(mesh, config.enable_prefix_caching,
                            config.layerwise_min_tokens) == (topology.paged_prefill
                                                            and not spec.colocated)
    pools = num_pools(mesh, topology.paged_prefill)
    if spec.elastic:
        assert pools == 2 * (spec.elastic - 1)
    else:
        assert pools == spec.decode_dp + (topology.paged_prefill and not spec.colocated)
    assert num_pools("prefill=2,decode=2", True) == 3
    assert num_pools("colocated=4", True) == 4


def test_the_default_splits_a_fraction_of_available_memory_over_the_pools():
    available = 24 * GIB
    for pools in (1, 2, 3, 4, 5, 8):
        each = default_budget("cpu", pools, available)
        share = available * CPU_KV_FRACTION / pools
        assert each <= min(share, CPU_KV_CACHE_BYTES)
        assert each >= min(share, CPU_KV_CACHE_BYTES) * 3 / 4     # coarse, never far below
        assert pools * each <= available * CPU_KV_FRACTION
    # A little more or less memory gives the same pool (kept executables keep their keys).
    assert default_budget("cpu", 3, 24 * GIB) == default_budget("cpu", 3, 24 * GIB - (200 << 20))
    assert default_budget("cpu", 1, 1000 * GIB) == CPU_KV_CACHE_BYTES      # the cap
    assert default_budget("cpu", 3, None) == CPU_KV_CACHE_BYTES            # unknown host
    # A prefill role paging nothing (layer-wise, or across processes) has no pool.
    assert default_budget("cpu", 0, 24 * GIB) == default_budget("cpu", 1, 24 * GIB)
    assert default_budget("gpu", 3, None, device_bytes=80 * GIB) == 40 * GIB
    assert default_budget("tpu", 3, None, device_bytes=None) == CPU_KV_CACHE_BYTES
    assert [coarse_floor(n) for n in (1, 8, 9, 10, 11, 13, 1000)] == [1, 8, 8, 10, 10, 12, 896]


def test_a_budget_whose_pools_exceed_what_is_available_is_refused():
    check_fits(GIB, 3, 3 * GIB)
    check_fits(100 * GIB, 3, None)
    with pytest.raises(ValueError, match=r"kv_cache_memory=4.00 GiB per pool x 3 pools needs "
                                         r"12.00 GiB .* but 10.00 GiB is available"):
        check_fits(4 * GIB, 3, 10 * GIB)


def test_the_plan_gives_pools_pages_bytes_context_and_concurrency():
    plan = KVPlan(pools=3, pages=1025, page_bytes=720 * 1024, page_size=16, max_model_len=8192,
                  decode_shards=2, slots_per_shard=32, budget=GIB, source="default")
    assert plan.total_bytes == 3 * 1025 * 720 * 1024
    assert plan.concurrency == 2 * 1024 / 512
    line = plan.describe()
    assert "3 pools x 1025 pages x 720.0 KiB = 2.11 GiB" in line
    assert "max_model_len 8192;" in line and "concurrency at full context: 4.00" in line
    assert "max_model_len 8192 (the model's);" in dataclasses.replace(
        plan, models_context=True).describe()
    few_slots = KVPlan(3, 1025, 1024, 16, 64, 2, 4, GIB, "x")
    assert few_slots.concurrency == 8                                 # the slots bind
    with pytest.raises(ValueError, match="KVPlan.pages"):
        KVPlan(3, 0, 1024, 16, 64, 2, 4, GIB, "x")


# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, 8,192 positions.
_SMOL = types.SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64,
                              max_position_embeddings=8192)
_PAGE = kv_page_bytes(30, 3, 64, 16, "float32")


def _fit(mesh="prefill=2,decode=2", kv=None, available=24 * GIB, monkeypatch=None, **options):
    """The context and pool `LLM` resolves for SmolLM2's shape (a dict)."""
    from jaxpd import llm
    from jaxpd.config import resolve_context

    monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
    asked = EngineConfig(mesh=mesh, **options)
    budget, source, pools = llm._kv_budget(asked, kv, multi_process=False)
    config = resolve_context(asked, _SMOL, budget or 0)
    llm._log_plan(asked, config, _SMOL, budget, source, pools)
    return {"max_model_len": config.max_model_len, "pages_per_shard": config.pages_per_shard}


def test_fit_splits_the_default_over_the_pools_and_logs_the_plan(monkeypatch, caplog):
    caplog.set_level("INFO", logger="jaxpd.llm")
    options = _fit(monkeypatch=monkeypatch)
    each = default_budget("cpu", 3, 24 * GIB)
    assert options["max_model_len"] == 8192
    assert options["pages_per_shard"] == each // _PAGE        # less the null page, plus it
    line = caplog.records[-1].getMessage()
    assert f"3 pools x {options['pages_per_shard']} pages" in line and "available" in line
    assert "concurrency at full context" in line and "max_model_len 8192 (the model's)" in line
    colocated = _fit("colocated=4", monkeypatch=monkeypatch)
    assert colocated["pages_per_shard"] == default_budget("cpu", 4, 24 * GIB) // _PAGE


def test_fit_refuses_bad_budgets_naming_the_field(monkeypatch):
    assert _fit(kv="512MiB", monkeypatch=monkeypatch)["pages_per_shard"] == (512 << 20) // _PAGE
    for bad, says in ((0, "positive"), (-5, "positive"), ("two gigs", "not a size"),
                      (_PAGE, "not one request"), ("4GiB", "needs 12.00 GiB")):
        with pytest.raises(ValueError, match=f"^kv_cache_memory=.*{says}"):
            _fit(kv=bad, available=10 * GIB, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="kv_cache_memory or pages_per_shard, not both"):
        _fit(kv="1GiB", monkeypatch=monkeypatch, pages_per_shard=100)
