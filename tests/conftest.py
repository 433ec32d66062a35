"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""
import atexit
import os
import shutil
import tempfile

# XLA:CPU compiles with LLVM at -O0: test programs are of tiny models, whose compile
# time is most of the suite's, and the code is the same program (no fast-math either
# way), so tokens do not change; nothing in a test times a program. Processes a test
# starts inherit the flag.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# transformers' reference forwards are of tiny models, a few tokens at a time: torch's
# intra-op threads add nothing to them but a wait at every op for cores the engine's
# threads (and, under -n, the other worker) are using. One thread, read by torch (and
# numpy's BLAS) when first imported, here and in every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Serializing every test engine's fresh compiles costs CI time and serves no later test:
# kept executables are on where a test serves at the library's defaults (it sets this
# back to "1" with monkeypatch) and in test_kept.
os.environ.setdefault("JAXPD_KEEP_EXECUTABLES", "0")
# One persistent XLA compilation cache for the session and every process it starts
# (launch subprocesses inherit it): the same tiny-model programs compile once, not in
# every engine. Removed at exit unless the caller chose the directory.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="jaxpd-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    atexit.register(shutil.rmtree, _xla_cache, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402  (after the environment above, which jax reads on import)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Tiny random HF checkpoints built once per session and shared by every module:
    `hf_models(name, **kwargs)` returns `(path, torch model)` for
    `build_hf_model(name, path, **kwargs)`. Both are shared: read them, never write."""
    from tests.hf_fixtures import build_hf_model   # torch: only for tests that need it

    built = {}

    def get(name: str, **kwargs):
        key = (name, tuple(sorted(kwargs.items())))
        if key not in built:
            path = str(tmp_path_factory.mktemp(f"hf_{name}"))
            built[key] = path, build_hf_model(name, path, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_hf_model(hf_models):
    """`(path, torch model)` of the default `llama_gqa` model most engine tests serve."""
    return hf_models("llama_gqa")


@pytest.fixture
def procs():
    """`tests.support.deployments.Procs`: launcher processes a test starts, stopped after it."""
    from tests.support.deployments import Procs

    p = Procs()
    yield p
    p.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`matrix` and `perf` cases are slow too, so `-m "not slow"` (which replaces
    setup.cfg's `-m`) still leaves them out of the fast tier."""
    for item in items:
        if item.get_closest_marker("matrix") or item.get_closest_marker("perf"):
            item.add_marker(pytest.mark.slow)
