"""One cache root: every kind of cache lives under `$JAXPD_CACHE`; the old variable
still works, with a warning, and the new one wins when both are set."""
from __future__ import annotations

import logging
import os

from jaxpd import paths


def test_every_cache_lives_under_the_one_root(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path))
    monkeypatch.delenv("JAXPD_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert paths.cache_root() == str(tmp_path)
    for kind, where in [(paths.models_dir, "models"), (paths.xla_dir, "compiled"),
                        (paths.native_dir, "native"), (paths.fingerprint_dir, "fingerprint")]:
        assert kind() == os.path.join(str(tmp_path), where)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert paths.xla_dir() == str(tmp_path / "jax")          # jax's own variable wins
    monkeypatch.delenv("JAXPD_CACHE")
    assert paths.cache_root() == os.path.expanduser("~/.cache/jaxpd")


def test_the_old_variable_is_a_deprecated_alias(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("JAXPD_CACHE", raising=False)
    monkeypatch.setenv("JAXPD_CACHE_DIR", str(tmp_path / "old"))
    monkeypatch.setattr(paths, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="jaxpd.paths"):
        assert paths.native_dir() == str(tmp_path / "old" / "native")
    assert "JAXPD_CACHE_DIR is deprecated" in caplog.text
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path / "new"))
    assert paths.cache_root() == str(tmp_path / "new")


def test_no_module_reads_a_cache_variable_but_paths():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readers = []
    for top in ("jaxpd", "models", "sharding", "transfer"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py") and name != "paths.py":
                    with open(os.path.join(dirpath, name)) as f:
                        text = f.read()
                    if '"JAXPD_CACHE' in text or "'JAXPD_CACHE" in text:
                        readers.append(os.path.join(dirpath, name))
    assert readers == []
