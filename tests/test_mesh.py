import jax
import pytest

from jaxpd.sharding import build_meshes, logical_rules
from jaxpd.sharding.spec import MeshSpec, parse_mesh_spec
from jaxpd.models.config import ModelConfig


@pytest.mark.parametrize("spec,expected", [
    ("prefill=4,decode=4", MeshSpec(4, 4, 1)),
    ("prefill=2,decode=2x2", MeshSpec(2, 2, 2)),
    ("prefill=1,decode=1", MeshSpec(1, 1, 1)),
    (" decode=3 , prefill=1 ", MeshSpec(1, 3, 1)),
    ("colocated=8", MeshSpec(8, 8, 1, colocated=True)),
    ("prefill=4", MeshSpec(4, 0, 1)),
    ("decode=2x2", MeshSpec(0, 2, 2)),
])
def test_parse(spec, expected):
    parsed = parse_mesh_spec(spec)
    assert parsed == expected
    assert parse_mesh_spec(str(parsed)) == parsed


@pytest.mark.parametrize("spec,bad", [
    ("prefill=4,decoder=4", "decoder=4"), ("prefill=x,decode=4", "prefill=x"),
    ("prefill=4,decode=4,prefill=2", "given twice"), ("colocated=4,decode=2", "stands alone"),
    ("prefill=2x2,decode=2", "DxT"), ("prefill=0,decode=0", "sizes must be >= 1"),
    ("", "expected a spec"), ("prefill4", "prefill4"),
])
def test_malformed_specs_name_the_bad_part(spec, bad):
    with pytest.raises(ValueError, match=bad):
        parse_mesh_spec(spec)


def test_meshes_are_disjoint_and_ordered():
    m = build_meshes("prefill=4,decode=2x2")
    devices = jax.devices()
    assert list(m.prefill.devices) == devices[:4]
    assert m.decode.devices.tolist() == [devices[4:6], devices[6:8]]
    assert m.decode.axis_names == ("dp", "tp")
    co = build_meshes("colocated=8")
    assert list(co.prefill.devices) == co.decode.devices.reshape(-1).tolist() == devices


def test_single_role_meshes():
    assert build_meshes("prefill=4").decode is None
    assert build_meshes("decode=4").prefill is None


def test_too_many_devices_says_how_to_get_more():
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=12"):
        build_meshes("prefill=8,decode=4")


def test_rules_replicate_what_does_not_divide():
    cfg = ModelConfig("llama", vocab_size=102, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    rules = dict(logical_rules(build_meshes("prefill=4,decode=4").prefill, **cfg.logical_dims()))
    assert rules["heads"] == "tp" and rules["mlp"] == "tp"
    assert rules["kv_heads"] is None            # 2 kv heads over tp=4: replicated
    assert rules["vocab"] is None               # 102 rows do not split 4 ways
    assert all(axis in (None, "tp") for axis in rules.values())   # never dp on weights


def test_rules_take_sizes_not_a_model():
    mesh = build_meshes("prefill=2,decode=2x2").decode       # tp=2 inside each dp shard
    rules = dict(logical_rules(mesh, num_heads=4, num_kv_heads=1, intermediate_size=6,
                               vocab_size=7))
    assert rules["heads"] == rules["mlp"] == "tp"
    assert rules["kv_heads"] is None and rules["vocab"] is None
    with pytest.raises(TypeError):
        logical_rules(mesh, 4, 1, 6, 7)                     # sizes are keyword-only


def test_replicated_over_tp_names_what_tp_does_not_divide():
    from jaxpd.sharding import replicated_over_tp
    dims = dict(num_heads=8, num_kv_heads=4, intermediate_size=768, vocab_size=4096)
    meshes = build_meshes("prefill=3,decode=1x4")
    assert replicated_over_tp(meshes.prefill, **dims) == \
        {"num_heads": 8, "num_kv_heads": 4, "vocab_size": 4096}      # only the MLP splits
    assert replicated_over_tp(meshes.decode, **dims) == {}
    assert replicated_over_tp(build_meshes("prefill=1,decode=3").decode, **dims) == {}


@pytest.mark.slow
def test_a_tp_that_divides_neither_heads_nor_vocab_serves_the_same_tokens(caplog):
    """What tp does not divide is replicated, by design, not refused: the programs,
    handoffs and kernels read each dimension's split from the rules, so such a mesh
    serves the tokens of a one-device mesh (tp=3 on 8 query and 4 kv heads and a
    vocabulary of 4,096, on the prefill and the decode mesh), and says at start what it
    replicates, naming each size and tp."""
    import logging

    from jaxpd import LLM, SamplingParams
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 140))]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for mesh in ("prefill=1,decode=1", "prefill=3,decode=1x3"):
        with caplog.at_level(logging.WARNING, logger="jaxpd.engine.engine"):
            with LLM(None, mesh=mesh, max_model_len=128, slots_per_shard=2,
                     warmup=False) as llm:
                outs[mesh] = [o.token_ids for o in llm.generate(
                    prompt_token_ids=prompts, sampling_params=greedy)]
    assert outs["prefill=3,decode=1x3"] == outs["prefill=1,decode=1"]
    said = [r.getMessage() for r in caplog.records if "does not divide" in r.getMessage()]
    assert len(said) == 2, said                             # the prefill and decode meshes
    assert all("tp=3 does not divide num_heads=8, num_kv_heads=4, vocab_size=4096" in m
               for m in said), said
