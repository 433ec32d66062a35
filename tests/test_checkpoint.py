"""Loading, orbax round trips, and clear errors for bad checkpoints and configs."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpd.models import checkpoint
from jaxpd.models.config import ModelConfig
from jaxpd.models.hf_io import save_hf_params
from jaxpd.models.layout import abstract_params
from jaxpd.sharding import build_meshes, logical_rules, named_shardings


@pytest.fixture(scope="module")
def hf_dir(hf_models):
    return hf_models("qwen2_bias")[0]   # shared with the parity tests (read only)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.slow
def test_orbax_round_trip_is_exact_including_onto_four_devices(hf_dir, tmp_path):
    loaded = checkpoint.load(hf_dir)
    checkpoint.save_params(loaded.params, str(tmp_path / "params"))
    back = checkpoint.restore_params(str(tmp_path / "params"), loaded.cfg)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, back)
    mesh = build_meshes("prefill=4,decode=4").prefill
    _, logical = abstract_params(loaded.cfg)
    shardings = named_shardings(logical, mesh, logical_rules(mesh, **loaded.cfg.logical_dims()))
    sharded = checkpoint.restore_params(str(tmp_path / "params"), loaded.cfg, shardings=shardings)
    q = sharded["layers_0"]["q_proj"]
    assert q.sharding == shardings["layers_0"]["q_proj"] and len(q.sharding.device_set) == 4
    assert len({s.data.shape for s in q.addressable_shards}) == 1
    assert q.addressable_shards[0].data.shape[1] == loaded.cfg.num_heads // 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, sharded)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_load_onto_a_mesh_reads_each_shard_alone_and_equals_the_whole(hf_dir, tp):
    """`load(shardings=)` of a safetensors checkpoint: every weight split over tp is
    read in tp parts of 1/tp each, from the file (`make_array_from_callback`: a process
    of a mesh spanning several asks only for its own shards); a replicated one once.
    Values and placement equal the whole load's."""
    from jaxpd.engine.programs.placement import checkpoint_shardings
    from jaxpd.models.hf_io import load_hf_params
    whole = checkpoint.load(hf_dir)
    mesh = build_meshes(f"prefill={tp}").prefill
    shardings = checkpoint_shardings(whole.cfg, mesh)
    sharded = checkpoint.load(hf_dir, shardings=lambda cfg: checkpoint_shardings(cfg, mesh))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 whole.params, sharded.params)
    jax.tree.map(lambda a, s: assert_sharding(a, s), sharded.params, shardings)
    shapes = jax.tree.map(lambda a: a.shape, whole.params)
    log: list = []
    load_hf_params(hf_dir, whole.cfg, "float32", shardings, shapes, read_log=log)
    reads: dict = {}
    for name, n in log:
        reads.setdefault(name, []).append(n)
    q = whole.params["layers_0"]["q_proj"].size
    assert reads["model.layers.0.self_attn.q_proj.weight"] == [q // tp] * tp
    assert reads["model.layers.0.self_attn.o_proj.weight"] == [q // tp] * tp
    assert len(reads["model.layers.0.self_attn.q_proj.bias"]) == tp
    assert reads["model.norm.weight"] == [whole.cfg.hidden_size]
    # One process holds every shard here: it reads every element once.
    total = sum(a.size for a in jax.tree.leaves(whole.params))
    assert sharded.weights_read == (total, total) == whole.weights_read


def assert_sharding(array, sharding):
    assert array.sharding == sharding


def test_converted_directory_loads_through_orbax(hf_dir, tmp_path):
    loaded = checkpoint.load(hf_dir)
    out = tmp_path / "converted"
    out.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), out)
    checkpoint.save_params(loaded.params, str(out / checkpoint.ORBAX_DIR))
    again = checkpoint.load(str(out))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, again.params)


def test_bfloat16_load(hf_dir):
    loaded = checkpoint.load(hf_dir, dtype="bfloat16")
    assert loaded.params["layers_0"]["q_proj"].dtype == jax.numpy.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        checkpoint.load(hf_dir, dtype="float16")


def test_sharded_safetensors_index(hf_dir, tmp_path):
    loaded = checkpoint.load(hf_dir)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(os.path.join(hf_dir, "config.json"), out)
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fn))
        weight_map.update({n: fn for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    again = checkpoint.load(str(out))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, again.params)
    os.remove(out / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        checkpoint.load(str(out))


def test_missing_files_are_named(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load(str(tmp_path / "nowhere"))
    d = _copy(hf_dir, tmp_path / "no_weights")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoint.load(d)
    d = _copy(hf_dir, tmp_path / "no_config")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        checkpoint.load(d)


def test_missing_weight_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "missing_weight")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        checkpoint.load(d)


def test_wrong_shape_is_named(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "wrong_shape")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        checkpoint.load(d)


def test_no_tokenizer_means_token_ids_only(hf_dir):
    assert checkpoint.load(hf_dir).tokenizer is None


def test_save_hf_params_round_trips(hf_dir, tmp_path):
    loaded = checkpoint.load(hf_dir)
    out = tmp_path / "resaved"
    save_hf_params(loaded.params, loaded.cfg, str(out))
    shutil.copy(os.path.join(hf_dir, "config.json"), out)
    again = checkpoint.load(str(out))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, again.params)


BASE = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)


@pytest.mark.parametrize("change,field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(model_type="mistral", sliding_window=16), "sliding_window"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0),
     "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "rope_scaling"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_unsupported_configs_are_refused_naming_the_field(change, field):
    cfg = {**BASE, **change}
    if cfg.get("vocab_size") is None:
        del cfg["vocab_size"]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(cfg)


def test_supported_config_details():
    cfg = ModelConfig.from_hf_dict({**BASE, "head_dim": 8, "eos_token_id": [2, 5],
                                    "model_type": "mistral", "sliding_window": None})
    assert cfg.head_dim == 8 and cfg.eos_token_ids == (2, 5)
    qwen = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "use_sliding_window": False,
                                     "sliding_window": 16})
    assert qwen.attention_bias


def test_which_loads_may_keep_weights_quantized(tmp_path):
    """`checkpoint.may_keep_quantized`, what `LLM()` asks to start the quantized
    products' build beside the load: int8 always, auto only for a GGUF file (or a
    directory holding one), none never."""
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    float_dir = tmp_path / "float"
    float_dir.mkdir()
    (float_dir / "config.json").write_text("{}")
    assert checkpoint.may_keep_quantized(str(gguf_file), "auto")
    assert checkpoint.may_keep_quantized(str(tmp_path), "auto")        # its one .gguf file
    assert not checkpoint.may_keep_quantized(str(float_dir), "auto")
    assert checkpoint.may_keep_quantized(str(float_dir), "int8")
    assert not checkpoint.may_keep_quantized(str(gguf_file), "none")
