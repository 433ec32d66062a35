"""The public API on the built-in default model: no arguments needed, text in, text out."""
import os
import re
import subprocess
import sys

import pytest

import jaxpd
import jaxpd.engine.scheduling.registry
import jaxpd.frontend
from jaxpd import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_one_shot_generate_with_the_default_model():
    outs = jaxpd.generate(["The list type", "Return the"],
                          SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                          mesh="prefill=1,decode=1", max_model_len=64)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.text and o.finish_reason == "length" for o in outs)
    assert outs[0].prompt_token_ids[0] == 1          # BOS from the shipped tokenizer


def test_text_and_token_prompts_agree_and_stream_text_adds_up(monkeypatch):
    checks = []
    counted = lambda check: lambda *a, **k: checks.append(1) or check(*a, **k)
    for module in (jaxpd.frontend, jaxpd.engine.scheduling.registry):
        monkeypatch.setattr(module, "check_request", counted(module.check_request))
    with LLM(mesh="prefill=2,decode=2", max_model_len=64, warmup=False) as llm:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        by_text = llm.generate("import", params)[0]
        assert len(checks) == 1          # the front door checks it; the engine trusts that
        by_ids = llm.generate(prompt_token_ids=[by_text.prompt_token_ids], sampling_params=params)[0]
        assert by_ids.token_ids == by_text.token_ids
        streamed = list(llm.stream("import", params))
        assert "".join(d.text for d in streamed) == by_text.text
        assert streamed[-1].finish_reason == by_text.finish_reason


def test_the_default_dtype_is_float32_on_cpu():
    with LLM(mesh="colocated=1", max_model_len=32, warmup=False) as llm:
        assert llm.config.dtype == "float32"
        assert llm.engine.decode_runner.k_pool.dtype == "float32"


# ---- LLM() on a plain CPU: no device count set by anyone -------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(source: str, **env) -> subprocess.CompletedProcess:
    """`source` in a fresh interpreter whose environment sets no CPU device count
    (neither XLA_FLAGS nor JAX_NUM_CPU_DEVICES), as a user's shell would have it."""
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    clean.update(PYTHONPATH=REPO, **env)
    return subprocess.run([sys.executable, "-c", source], env=clean, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def readme_python_example() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"^```python\n(.*?)^```$", f.read(), re.M | re.S)
    assert len(blocks) == 1 and "LLM(" in blocks[0], "README.md's Python example moved"
    return blocks[0]


def test_the_readme_python_example_runs_as_written_without_xla_flags():
    out = run_python(readme_python_example())
    assert out.returncode == 0, out.stderr
    # The text, its finish reason and TTFT, then the streamed deltas.
    printed = re.fullmatch(r"(.+) (length|stop) [\d.e-]+\n(.+)", out.stdout, re.S)
    assert printed and printed[1].strip() and printed[3].strip(), out.stdout
    assert "mesh=auto:" not in out.stderr                 # one device per role, no fallback


def test_llm_on_one_cpu_device_already_running_fits_auto_and_refuses_a_bigger_mesh():
    out = run_python(
        "import jax; jax.devices()\n"                      # backends up with one device
        "from jaxpd import LLM, SamplingParams\n"
        "with LLM(model=None, mesh='auto', max_model_len=32, warmup=False) as llm:\n"
        "    print('mesh', llm.config.mesh)\n"
        "    print(llm.generate('import', SamplingParams(max_tokens=4, ignore_eos=True))"
        "[0].finish_reason)\n"
        "try:\n"
        "    LLM(model=None, mesh='prefill=1,decode=1', warmup=False)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["mesh colocated=1", "length"], out.stdout
    assert re.match(r"refused: mesh prefill=1,decode=1 needs 2 devices but only 1 cpu", lines[2])
    said = [line for line in out.stderr.splitlines() if "mesh=auto:" in line]
    assert len(said) == 1 and "1 cpu device(s)" in said[0] and "colocated=1" in said[0]


def test_a_device_count_the_user_set_or_a_platform_without_cpu_is_left_alone():
    probe = ("from jaxpd.sharding.cpu_devices import ensure_cpu_devices\n"
             "print(ensure_cpu_devices('prefill=2,decode=2'))\n"
             "import jax; print(jax.config.jax_num_cpu_devices)\n")
    out = run_python(probe + "print(jax.device_count())",
                     XLA_FLAGS="--xla_force_host_platform_device_count=3")
    assert out.stdout.split() == ["None", "-1", "3"], out.stderr
    out = run_python(probe, JAX_NUM_CPU_DEVICES="5")
    assert out.stdout.split() == ["None", "5"], out.stderr
    # Not asked, and nothing started to find out: tpu is absent here, and no error says so.
    out = run_python(probe, JAX_PLATFORMS="tpu")
    assert out.stdout.split() == ["None", "-1"], out.stderr
    out = run_python(probe + "print(jax.device_count())", JAX_PLATFORMS="cpu")
    assert out.stdout.split() == ["4", "4", "4"], out.stderr
