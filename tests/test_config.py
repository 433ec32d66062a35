"""EngineConfig and the serving dtype (plain Python, no model)."""
import pytest

from jaxpd.config import EngineConfig, resolve_dtype


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
