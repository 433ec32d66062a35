"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
