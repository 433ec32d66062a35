"""`jaxpd.export`: every serving program lowered for TPU and GPU on this CPU host, with
the mesh's shardings and the platform's kernel; the files deserialize for their
platform; bad flags fail before lowering; exported programs run against the
reference (`jaxpd.export.execute`, the device check's logic, on CPU)."""
import json
import os
import subprocess

import pytest

from tests.support.random_llama import write_random_llama

jax = pytest.importorskip("jax")
from jax import export  # noqa: E402

from jaxpd.export import export_programs, register_pytrees  # noqa: E402
from jaxpd.export.__main__ import main  # noqa: E402

# Tiny engines: two prompt buckets, two decode row counts, few programs.
_SMALL = dict(max_model_len=32, max_prefill_batch=2, slots_per_shard=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random Llamas by head dim: 128 with 8/4 heads (G 2; kv heads split over tp 4),
    64 with 4/1 (G 4; the kv head replicated over tp)."""
    root = tmp_path_factory.mktemp("export_models")
    return {128: write_random_llama(str(root / "h128"), 128, num_heads=8, num_kv_heads=4),
            64: write_random_llama(str(root / "h64"), 64, num_heads=4, num_kv_heads=1),
            None: None}


def _check(summary, out, platform, kernel):
    """Every program in `summary` deserializes for `platform` with the mesh's device
    count, and the decode steps run `kernel` (the TPU one: a Mosaic call)."""
    register_pytrees()
    programs = summary["programs"]
    names = {p["name"] for p in programs}
    assert len(names) == len(programs)
    assert any(n.startswith("decode_rows") for n in names)
    assert any(n.startswith("insert_m") for n in names)
    assert "penalties_set_slot" in names
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["programs"] == programs
    devices = {"prefill": None, "decode": None}
    for p in programs:
        with open(os.path.join(out, p["file"]), "rb") as f:
            data = f.read()
        assert len(data) == p["bytes"]
        exported = export.deserialize(data)
        assert exported.platforms == (platform,)
        role = "decode" if p["name"].startswith(("decode", "insert", "penalties", "extend")) \
            else "prefill"
        devices[role] = devices[role] or exported.nr_devices
        assert exported.nr_devices == devices[role], p["name"]
        if p["name"].startswith("decode_rows"):
            assert p["kernel"] == kernel
            assert ("tpu_custom_call" in exported.mlir_module()) == (kernel == "pallas_tpu")
            if kernel == "pallas_gpu":
                assert "xla.gpu.triton" in exported.mlir_module()
    return devices


def _export(tmp_path, platform, mesh, model, **options):
    out = str(tmp_path / f"{platform}")
    return export_programs(platform, mesh, model=model, out=out, **(_SMALL | options)), out


@pytest.mark.slow
def test_tpu_kernel_lowers_in_every_decode_program_on_a_dp_tp_mesh(tmp_path, models):
    summary, out = _export(tmp_path, "tpu", "prefill=2,decode=2x2", models[128])
    assert summary["attention_impl"] == "pallas_tpu"         # auto's pick: bfloat16, H 128
    assert summary["dtype"] == "bfloat16"
    assert _check(summary, out, "tpu", "pallas_tpu") == {"prefill": 2, "decode": 4}
    decode = next(p for p in summary["programs"] if p["name"].startswith("decode_rows"))
    assert "P(None, 'dp', None, 'tp', None)" in decode["in_shardings"]    # the pool


# The built-in model (head_dim None, 8/4 heads as the 128 one) with the reference core
# on a platform and mesh another case already lowers (cuda 2x2: the 128 model; tpu
# prefill=4,decode=4: the float32 full-bucket test below) runs in the matrix only.
@pytest.mark.slow
@pytest.mark.parametrize("platform,mesh,head_dim,impl,kernel", [
    ("tpu", "prefill=4,decode=4", 128, "auto", "pallas_tpu"),
    ("tpu", "prefill=4,decode=4", 64, "auto", "reference"),
    ("tpu", "prefill=2,decode=2x2", None, "auto", "reference"),
    pytest.param("tpu", "prefill=4,decode=4", None, "auto", "reference",
                 marks=pytest.mark.matrix),
    ("cuda", "prefill=4,decode=4", 128, "pallas_gpu", "pallas_gpu"),
    ("cuda", "prefill=2,decode=2x2", 64, "pallas_gpu", "pallas_gpu"),
    ("cuda", "prefill=2,decode=2x2", 128, "auto", "reference"),
    ("cuda", "prefill=4,decode=4", None, "pallas_gpu", "pallas_gpu"),
    pytest.param("cuda", "prefill=2,decode=2x2", None, "auto", "reference",
                 marks=pytest.mark.matrix),
])
def test_every_serving_program_lowers(tmp_path, models, platform, mesh, head_dim, impl,
                                      kernel):
    summary, out = _export(tmp_path, platform, mesh, models[head_dim], attention_impl=impl)
    _check(summary, out, platform, kernel)


@pytest.mark.slow
def test_float32_and_the_full_bucket_set_of_the_built_in_model(tmp_path):
    out = str(tmp_path)
    summary = export_programs("tpu", "prefill=4,decode=4", dtype="float32", max_model_len=128,
                              out=out)
    assert summary["dtype"] == "float32" and summary["attention_impl"] == "reference"
    _check(summary, out, "tpu", "reference")
    # Every bucket, chunk, prefix and take program the engine serves, not a sample.
    names = {p["name"] for p in summary["programs"]}
    assert {"prefill_cached_b1_t128_w0", "prefill_cached_b8_t16_w8", "prefill_cached_take_m8",
            "decode_rows128_w8", "insert_m8", "extend_rows16_t128_w8"} <= names


@pytest.mark.slow
def test_layer_wise_prefill_lowers_as_its_embed_blocks_and_head(tmp_path, models):
    out = str(tmp_path)
    summary = export_programs("tpu", "prefill=2,decode=2", model=models[128], out=out,
                              layerwise_min_tokens=32, enable_prefix_caching=False, **_SMALL)
    names = {p["name"] for p in summary["programs"]}
    # Two layers in groups of one: one blocks program per bucket from 32 tokens on.
    assert {"prefill_b2_t16", "prefill_embed_b2_t32", "prefill_blocks1_b2_t32",
            "prefill_head_b2_t32"} <= names
    assert "prefill_b2_t32" not in names
    _check(summary, out, "tpu", "pallas_tpu")


def test_bad_flags_fail_before_lowering(tmp_path, models):
    out = str(tmp_path / "never")
    with pytest.raises(ValueError, match="--platform must be one of tpu, cuda, cpu"):
        export_programs("gpu", out=out)
    with pytest.raises(ValueError, match="--dtype must be one of"):
        export_programs("tpu", dtype="float16", out=out)
    with pytest.raises(ValueError, match="--mesh 'prefill=x'"):
        export_programs("tpu", "prefill=x", out=out)
    with pytest.raises(ValueError, match="--mesh prefill=8,decode=4 needs 12 devices"):
        export_programs("tpu", "prefill=8,decode=4", out=out)
    with pytest.raises(ValueError, match="--attention_impl 'pallas_tpu'.*multiple of 128.*64"):
        export_programs("tpu", model=models[64], attention_impl="pallas_tpu", out=out)
    with pytest.raises(ValueError, match="--attention_impl 'pallas_gpu'.*cannot run on tpu"):
        export_programs("tpu", attention_impl="pallas_gpu", out=out)
    with pytest.raises(ValueError, match="--attention_impl 'native'.*float32 only"):
        export_programs("cpu", dtype="bfloat16", attention_impl="native", out=out)
    with pytest.raises(ValueError, match="--max_model_len 4096 exceeds"):
        export_programs("tpu", max_model_len=4096, out=out)
    with pytest.raises(ValueError, match=r"--match '\(' is not a regular expression"):
        export_programs("tpu", match="(", out=out)
    assert not os.path.exists(out)
    assert main(["--platform", "tpu", "--mesh", "decode=0", "--out", out]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--platform", "rocm", "--out", out])
    assert e.value.code == 2


def test_tpu_decode_program_carries_the_mosaic_kernel(tmp_path, models):
    """The fast tier's export: one decode mesh of dp 2 x tp 2 for TPU, the smallest
    engine (one bucket, one decode width)."""
    out = str(tmp_path)
    summary = export_programs("tpu", "decode=2x2", model=models[128], out=out,
                              max_model_len=16, max_prefill_batch=1, slots_per_shard=1,
                              enable_prefix_caching=False)
    assert summary["attention_impl"] == "pallas_tpu"
    assert _check(summary, out, "tpu", "pallas_tpu")["decode"] == 4


def test_a_program_that_fails_to_lower_is_named_with_its_shapes(tmp_path, models,
                                                                 monkeypatch):
    from jaxpd.models import pallas_attention

    def broken(*args, **kwargs):
        raise ValueError("block shape refused")
    monkeypatch.setattr(pallas_attention, "paged_attention_tpu", broken)
    with pytest.raises(RuntimeError, match=r"lowering decode_rows2_w1 \(kernel pallas_tpu\) "
                                           r"for tpu failed.*bfloat16\[2, 4, 16, 4, 128\]"
                                           r".*block shape refused"):
        export_programs("tpu", "decode=2", model=models[128], out=str(tmp_path),
                        max_model_len=16, max_prefill_batch=1, slots_per_shard=1,
                        enable_prefix_caching=False)


@pytest.mark.slow
def test_exported_programs_run_against_the_reference(tmp_path):
    """launch/export_check.sh, the device check's export-and-run step, on this CPU:
    the native kernel's programs against the reference's, on the same inputs. Only
    the programs run are exported: the engine tests compile every program for CPU, and
    the cases above lower each one for TPU and GPU."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    match = "^(decode|prefill_b1_t16|insert_m1$|penalties)"
    run = subprocess.run(["bash", "launch/export_check.sh", "cpu", "auto", "-", str(tmp_path),
                          "32", match, "matched"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr + open(tmp_path / "export.log").read()
    rows = [line.split() for line in run.stdout.splitlines()
            if line.endswith(" ok") and not line.startswith("program")]
    names = {r[0] for r in rows}
    assert {"decode_rows32_w2", "prefill_b1_t16", "insert_m1", "penalties_set_slot"} <= names
    for r in rows:
        assert float(r[2]) <= 2e-3, r                      # relative error vs the reference
    with open(tmp_path / "programs" / "summary.json") as f:
        summary = json.load(f)
    assert summary["platform"] == "cpu" and summary["mesh"] == "colocated=1"
    assert {p["name"] for p in summary["programs"]} == names   # exported: those matched
