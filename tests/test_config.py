"""EngineConfig, the serving dtype and the "auto" mesh (plain Python, no model)."""
import dataclasses
import os

import pytest

from jaxpd.config import EngineConfig, fit_context, kv_page_bytes, resolve_dtype
from jaxpd.sharding.cpu_devices import set_cpu_device_count
from jaxpd.sharding.spec import auto_mesh, parse_mesh_spec


@pytest.mark.parametrize("backend, dtype", [("cpu", "float32"), ("gpu", "bfloat16"),
                                            ("tpu", "bfloat16")])
def test_auto_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators(backend, dtype):
    assert resolve_dtype("auto", backend) == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_every_backend(dtype):
    assert resolve_dtype(dtype, "cpu") == resolve_dtype(dtype, "gpu") == dtype


def test_bad_dtypes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="dtype must be 'auto', 'float32' or 'bfloat16'"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="auto")        # the engine takes a resolved dtype


@pytest.mark.parametrize("platform,num,role,mesh", [
    ("cpu", 8, None, "prefill=1,decode=1"), ("cpu", 2, None, "prefill=1,decode=1"),
    ("cpu", 8, "prefill", "prefill=1"), ("cpu", 1, "decode", "decode=1"),
    ("gpu", 8, None, "prefill=4,decode=4"), ("tpu", 3, None, "prefill=1,decode=2"),
    ("gpu", 1, None, "colocated=1"), ("tpu", 4, "prefill", "prefill=4"),
    ("gpu", 2, "decode", "decode=2")])
def test_auto_mesh_is_one_device_per_role_on_cpu_and_a_split_elsewhere(platform, num, role,
                                                                        mesh):
    assert auto_mesh(platform, num, role) == mesh
    assert str(parse_mesh_spec(mesh)) == mesh


def test_auto_mesh_refuses_bad_input_and_the_launcher_makes_its_devices():
    with pytest.raises(ValueError, match="role must be None, 'prefill' or 'decode'"):
        auto_mesh("cpu", 8, "router")
    with pytest.raises(ValueError, match="at least one device"):
        auto_mesh("gpu", 0)
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"}
    assert set_cpu_device_count("auto", environ) == 2
    assert environ["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=2"


@pytest.mark.parametrize("mesh, options, on", [
    ("prefill=1,decode=1", {}, True), ("prefill=4,decode=4", {}, True),
    ("colocated=8", {}, False), ("prefill=4", {}, True), ("decode=2", {}, True),
    ("elastic=8", {}, False),
    ("prefill=1,decode=1", {"layerwise_min_tokens": 64}, False),
    ("prefill=1,decode=1", {"kv_transfer_dtype": "int8"}, False),
    ("prefill=1,decode=1", {"enable_prefix_caching": False}, False),
    ("colocated=2", {"enable_prefix_caching": True}, True)])
def test_prefix_caching_is_on_by_default_only_where_measured_not_to_lose(mesh, options, on):
    # Disaggregated meshes: one process with a prefill mesh beside its decode mesh, and
    # the role processes' own meshes; an explicit choice stands.
    assert EngineConfig(mesh=mesh, **options).enable_prefix_caching is on


def test_the_launcher_leaves_prefix_caching_to_the_engine_unless_told():
    from absl import flags

    from jaxpd.serving import launch_flags
    for argv, value in ((["prog"], None), (["prog", "--enable_prefix_caching"], True),
                        (["prog", "--noenable_prefix_caching"], False)):
        fv = flags.FlagValues()
        launch_flags.define_flags(fv)
        fv(argv)
        assert fv.enable_prefix_caching is value
    # ... but a role spanning processes, which does not support it yet, resolves off.
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", "--role", "prefill", "--num_processes", "2", "--coordinator", "127.0.0.1:1"])
    assert launch_flags.engine_options(fv)["enable_prefix_caching"] is False


def test_the_context_defaults_to_the_models_and_the_pool_to_the_kv_budget():
    page = kv_page_bytes(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16,
                         dtype="float32")
    assert page == 2 * 30 * 16 * 3 * 64 * 4
    # SmolLM2's 8,192 tokens in 4 GiB: every one of 8 slots reaches it.
    assert fit_context(8192, page, 16, 4 << 30, 8) == (8192, 8 * 512 + 1)
    # A budget of 1,000 pages: the whole context still fits once; slots share the pool.
    assert fit_context(8192, page, 16, 1001 * page, 8) == (8192, 1001)
    # One of 300 pages cannot hold 8,192 tokens: the default is cut to what it holds ...
    assert fit_context(8192, page, 16, 301 * page, 8) == (300 * 16, 301)
    # ... and an explicit context that does not fit is refused, naming both fields.
    with pytest.raises(ValueError, match="max_model_len=8192 does not fit kv_cache_memory"):
        fit_context(8192, page, 16, 301 * page, 8, max_model_len=8192)
    assert fit_context(8192, page, 16, 4 << 30, 8, max_model_len=1000) == (1000, 8 * 63 + 1)
    with pytest.raises(ValueError, match="not one request"):
        fit_context(8192, page, 16, page, 8)
    assert kv_page_bytes(30, 3, 64, 16, "bfloat16") == page // 2


def test_the_chunk_is_a_power_of_two_no_smaller_than_a_bucket():
    assert EngineConfig(mesh="prefill=1,decode=1", prefill_chunk_tokens=512).prefill_chunk_tokens \
        == 512
    for bad in (100, 8, 0):
        with pytest.raises(ValueError, match="prefill_chunk_tokens must be a power of two"):
            EngineConfig(mesh="prefill=1,decode=1", prefill_chunk_tokens=bad)


def test_every_engine_config_field_has_a_flag_whose_default_is_the_fields():
    """The launcher's flags are generated from EngineConfig: one per field, by name,
    with its default (or the `launch_default` LLM resolves) and its help."""
    from absl import flags

    from jaxpd.serving import launch_flags
    from jaxpd.serving.config_flags import flag_default
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog"])
    for field in dataclasses.fields(EngineConfig):
        flag = fv[field.name]
        assert flag.default == flag_default(field), field.name
        assert flag.help.endswith(field.metadata["help"]), field.name
        if "launch_default" not in field.metadata:
            assert flag.default == field.default, field.name
    # The two LLM resolves: auto mesh and dtype (the model's own context is
    # EngineConfig's default, None, resolved by `resolve_context`).
    assert {f.name for f in dataclasses.fields(EngineConfig) if "launch_default" in f.metadata
            } == {"mesh", "dtype"}
    # Unset flags leave EngineConfig's defaults standing: the options build the default.
    options = launch_flags.engine_options(fv)
    assert options.pop("mesh") == "auto" and options.pop("dtype") == "auto"
    assert EngineConfig(**options) == EngineConfig()
    # Set ones reach EngineConfig by field name; aliases keep working.
    fv.unparse_flags()
    fv(["prog", "--page_size", "32", "--kv_part_timeout_s", "2.5", "--attention_interpret",
        "--shutdown_grace_s", "1"])
    options = launch_flags.engine_options(fv)
    assert (options["page_size"], options["kv_part_timeout_s"]) == (32, 2.5)
    assert options["attention_interpret"] is True and fv.shutdown_timeout_s == 1.0
    with pytest.raises(flags.IllegalFlagValueError):
        fv(["prog", "--page_size", "0"])                 # the field's lower bound


def _model(context=8192, **fields):
    from jaxpd.models.config import ModelConfig
    return ModelConfig(**{**dict(model_type="llama", vocab_size=49152, hidden_size=576,
                                 intermediate_size=1536, num_layers=30, num_heads=9,
                                 num_kv_heads=3, head_dim=64,
                                 max_position_embeddings=context), **fields})


def test_one_rule_resolves_the_context_for_a_config_built_directly_or_by_llm():
    """`EngineConfig` leaves `max_model_len` unset (None) until `resolve_context` meets
    the model: `LLM` and an `Engine` built from a config both call it, so both serve
    the model's own context by default, cut only by the KV budget."""
    from jaxpd.config import resolve_context
    page = kv_page_bytes(30, 3, 64, 16, "float32")
    unset = EngineConfig(mesh="prefill=1,decode=1", slots_per_shard=8)
    assert unset.max_model_len is None and not unset.resolved
    with pytest.raises(ValueError, match="unset until resolved"):
        unset.buckets
    c = resolve_context(unset, _model(), 4 << 30)
    assert c.resolved and (c.max_model_len, c.pages_per_shard) == (8192, 8 * 512 + 1)
    assert c.max_prompt_len == 8191 and c.buckets[-1] == 8192
    assert resolve_context(c, _model(), 4 << 30) == c           # resolved: unchanged
    # An asked context: what the config derived from it stands once resolved.
    asked = resolve_context(dataclasses.replace(unset, max_model_len=4608), _model(), 4 << 30)
    assert (asked.max_model_len, asked.max_prompt_len, asked.max_prefill_tokens) == \
        (4608, 4607, 2048)
    # The same numbers as `fit_context`: a small budget cuts the default context ...
    assert resolve_context(unset, _model(), 301 * page).max_model_len == 300 * 16
    # ... an asked one it cannot hold, or past the model's, is refused naming both.
    with pytest.raises(ValueError, match="max_model_len=8192 does not fit kv_cache_memory"):
        resolve_context(dataclasses.replace(unset, max_model_len=8192), _model(), 301 * page)
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds the model's "
                                         "max_position_embeddings=8192"):
        resolve_context(dataclasses.replace(unset, max_model_len=9000), _model(), 4 << 30)
    # A given pool keeps the model's context (and must hold one request of it).
    given = resolve_context(dataclasses.replace(unset, pages_per_shard=600), _model(), 1)
    assert (given.max_model_len, given.pages_per_shard) == (8192, 600)
    with pytest.raises(ValueError, match="pages_per_shard=100 cannot hold one request"):
        resolve_context(dataclasses.replace(unset, pages_per_shard=100), _model(), 1)


def test_xla_compute_threads_follow_the_device_count_above_the_cpus(caplog):
    """XLA:CPU's pool is max($NPROC or the CPUs, the device count): a count above the
    CPUs is said once, in one line naming both; a user's NPROC is read as XLA reads it."""
    from jaxpd.sharding import cpu_devices
    cpus = len(os.sched_getaffinity(0))
    assert cpu_devices.compute_threads(1, {}) == (cpus, cpus)
    assert cpu_devices.compute_threads(cpus + 6, {}) == (cpus + 6, cpus)
    assert cpu_devices.compute_threads(1, {"NPROC": "3"}) == (3, cpus)
    assert cpu_devices.compute_threads(2, {"NPROC": "zero"}) == (max(cpus, 2), cpus)
    cpu_devices._said.clear()
    with caplog.at_level("WARNING", logger="jaxpd.cpu_devices"):
        assert cpu_devices.say_if_oversubscribed(cpus, {}) == cpus
        assert not caplog.records
        for _ in range(2):
            assert cpu_devices.say_if_oversubscribed(cpus + 6, {}) == cpus + 6
    assert len(caplog.records) == 1
    assert f"{cpus + 6} threads on {cpus} CPU(s)" in caplog.records[0].getMessage()
