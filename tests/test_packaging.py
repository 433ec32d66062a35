"""Import hygiene and packaging.

The router role and the pure-Python modules must not load jax or flax (the router
process needs no accelerator), and the wheel installs everything under `jaxpd.` so a
user's own `models` package is never shadowed. Each check runs in a fresh interpreter:
this test process has loaded jax long ago.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("jax", "jaxlib", "flax")
SHOW_HEAVY = ("import sys; print(sorted(m for m in sys.modules "
              f"if m.split('.')[0] in {HEAVY!r}))")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT}


def _python(code: str, *flags: str, cwd: str = ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["jaxpd", "jaxpd.metrics", "jaxpd.errors",
                                    "jaxpd.sharding.spec", "jaxpd.config", "jaxpd.frontend",
                                    "jaxpd.models.config", "jaxpd.models.tokenizer",
                                    "jaxpd.transfer.wire", "jaxpd.serving.router",
                                    "jaxpd.paths", "jaxpd.serving.config_flags",
                                    "jaxpd.sharding.cpu_devices", "jaxpd.models.fingerprint",
                                    "jaxpd.parsing", "jaxpd.engine.scheduling.buckets"])
def test_pure_modules_load_no_jax(module):
    out = _python(f"import {module}; {SHOW_HEAVY}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout}"


def test_no_test_module_imports_another():
    """Shared test helpers live in tests/support/ or the fixture modules: a test module
    imports no other test module (nor its fixtures, which would run twice)."""
    import ast
    tests = os.path.join(ROOT, "tests")
    importers = []
    for dirpath, _, files in os.walk(tests):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                           [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if isinstance(node, ast.ImportFrom) and node.module in ("tests", None):
                    modules += [a.name for a in node.names]
                for module in modules:
                    if module.rsplit(".", 1)[-1].startswith("test_"):
                        importers.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} "
                                         f"imports {module}")
    assert importers == []


def _package_imports(path: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every `from jaxpd... import ...` in the file at `path`,
    whether at the top or inside a function."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return [(n.lineno, n.module, [a.name for a in n.names]) for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jaxpd")]


def _package_modules() -> dict[str, str]:
    """jaxpd module name -> source path, for the package and the three root layers."""
    found = {}
    for top, package in (("jaxpd", "jaxpd"), ("models", "jaxpd.models"),
                         ("sharding", "jaxpd.sharding"), ("transfer", "jaxpd.transfer")):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("models", "__pycache__")
                       or dirpath != os.path.join(ROOT, "jaxpd")]
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name[:-3]),
                                          os.path.join(ROOT, top)).replace(os.sep, ".")
                    module = package if rel == "__init__" else f"{package}.{rel}"
                    found[module.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return found


# Owned by another change in flight (the router's relay); checked once it lands.
_ROUTER = ("jaxpd.serving.router", "jaxpd.serving.router_flow")


def test_no_private_name_is_imported_across_modules():
    imports = []
    for module, path in _package_modules().items():
        if module in _ROUTER:
            continue
        for line, source, names in _package_imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and source != module:
                imports.append(f"{module}:{line} imports {private} from {source}")
    assert imports == []


def test_no_import_circles_between_package_modules():
    modules = _package_modules()
    edges = {m: {s for _, s, _ in _package_imports(p) if s in modules and s != m}
             for m, p in modules.items() if m not in _ROUTER}
    circles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a]
                     if a < b and a in edges.get(b, ()))
    assert circles == []


def test_lazy_exports_still_resolve():
    out = _python("import jaxpd, jaxpd.sharding, jaxpd.transfer; "
                  "from jaxpd.sharding.spec import parse_mesh_spec; "
                  "assert parse_mesh_spec('decode=2x2').num_devices == 4; "
                  "assert jaxpd.transfer.WireVersionError.__module__ == 'jaxpd.transfer.wire'; "
                  "assert callable(jaxpd.sharding.build_meshes); "
                  "assert 'build_meshes' in dir(jaxpd.sharding); "
                  "print(jaxpd.SamplingParams(max_tokens=3).max_tokens)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def _imported(importtime_log: str) -> set[str]:
    """Module names from `python -X importtime` output (stderr)."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_log.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_router_role_imports_no_jax_or_flax(tmp_path):
    """The real `python -m jaxpd.launch --role router`, started until it polls its
    (unreachable) workers and then stopped: every module it imported along the way,
    shutdown included, comes from `-X importtime`."""
    cmd = [sys.executable, "-X", "importtime", "-m", "jaxpd.launch", "--role", "router",
           "--port", "0", "--http_port", "0", "--host", "127.0.0.1", "--max_model_len", "160",
           "--prefill_workers", "127.0.0.1:1", "--decode_workers", "127.0.0.1:2"]
    log = tmp_path / "importtime.log"      # a file: a full stderr pipe would block it
    with open(log, "w") as stderr:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=stderr,
                             text=True)
    watchdog = threading.Timer(120, p.kill)    # a hung start fails instead of hanging
    watchdog.start()
    try:
        line = p.stdout.readline() + p.stdout.readline()   # internal plane, then public port
        assert "jaxpd router listening" in line, line + log.read_text()[-3000:]
        time.sleep(1.0)            # a few readiness polls: Info RPCs to the workers
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, line + out + log.read_text()[-3000:]
    imported = _imported(log.read_text())
    assert "jaxpd.serving.router" in imported and "grpc" in imported   # the log is complete
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel built from a copy of the source tree (building in place would leave a
    build/ directory whose stale files the next build would ship)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "bench_out"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (built,) = (tmp / "dist").glob("jaxpd-*.whl")
    return str(built)


@pytest.mark.slow
def test_wheel_is_namespaced_under_jaxpd(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for path in ("jaxpd/models/__init__.py", "jaxpd/sharding/__init__.py",
                 "jaxpd/sharding/spec.py", "jaxpd/transfer/__init__.py",
                 "jaxpd/transfer/wire.py", "jaxpd/serving/proto/jaxpd_pb2.py",
                 "jaxpd/default_model/model.safetensors"):
        assert path in names, f"{path} missing from the wheel"
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"jaxpd"}, tops


@pytest.mark.slow
def test_installed_wheel_has_no_top_level_models(wheel, tmp_path):
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                          "--target", str(site), wheel],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -S: no site-packages (so not this checkout's editable install either), like a
    # clean environment; these modules need only the standard library.
    code = ("import jaxpd.models.config, jaxpd.sharding.spec\n"
            "print(jaxpd.models.config.__file__)\n"
            "try:\n"
            "    import models\n"
            "except ModuleNotFoundError as e:\n"
            "    print('no', e.name)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run = _python(code, "-S", cwd=str(elsewhere), env={**env, "PYTHONPATH": str(site)})
    assert run.returncode == 0, run.stderr
    file, missing = run.stdout.splitlines()
    assert file.startswith(str(site / "jaxpd" / "models"))
    assert missing == "no models"


# Every test file that serves without warm-up (`warmup=False`, the launcher's
# `--nowarmup`), and why. The path users take (`LLM()`, the launcher) warms up and
# keeps its executables: a test leaves it only when warm-up is what it is about, when
# it needs programs compiled on demand, or when warming up would cost CI time the test
# does not need because the same mesh and model run at the defaults elsewhere.
_CI_TIME = ("CI time: its requests run a few of the programs warm-up would compile; "
            "the path at the defaults is held by the parity tests")
_PREFIX = ("prefix-cache tests: their hit and routing counts assume the decode mesh's "
           "prefills with a prefix compile on first demand (after warm-up they compile "
           "in the background and requests go the cache-off way meanwhile); the "
           "defaults' path is test_prefix_first_repeat's")
COLD_TESTS = {
    "support/deployments.py": "launcher processes for router, fault and soak tests "
                              "(the launcher warms up in test_server's launch test): "
                              + _CI_TIME,
    "support/gil_worker.py": "a prefill worker whose prefills hold the GIL, for "
                             "heartbeat tests: " + _CI_TIME,
    "support/internal_plane.py": "role engines under internal-plane checks (auth, peer "
                                 "input): " + _CI_TIME,
    "support/prefix_chats.py": _PREFIX,
    "support/quant_blocks.py": "float and kept-block engines compared to each other, "
                               "two per case: " + _CI_TIME,
    "test_api.py": "front-door checks and the built-in model's dtype and `mesh='auto'`: "
                   + _CI_TIME,
    "test_chunked_prefill.py": "contexts up to 1024 tokens: warm-up would compile every "
                               "bucket and chunk program for scheduling checks",
    "test_colocated_chunks.py": "chunk scheduling of long prompts: " + _CI_TIME,
    "test_elastic.py": "an elastic mesh warms every split it builds (two per re-split): "
                       + _CI_TIME,
    "test_engine.py": "preemption, failure, shutdown, local prefill, compression on "
                      "engines beside the mesh test, which runs at the defaults: " + _CI_TIME,
    "test_gguf.py": "a GGUF file at the model's own context on colocated=1: " + _CI_TIME,
    "test_handoff_identity.py": "a decode-only engine built for its receiver's identity, "
                                "no request served",
    "test_handoff_stall.py": "the order of a pulling connector's waits and sends; the "
                             "same mesh's parity runs at the defaults in this file",
    "test_host_tier.py": _PREFIX,
    "test_http.py": "HTTP protocol on a module engine and launcher processes: " + _CI_TIME,
    "test_layerwise.py": "layer-wise transfer and its faults (dropping and aborting "
                         "connectors): " + _CI_TIME,
    "test_migration.py": "engines of two roles per case, moved between: " + _CI_TIME,
    "test_memory.py": "what shutdown drops, on an engine that served one request; the "
                      "cycles test beside it runs at the defaults",
    "test_mesh.py": "a tp that divides neither heads nor vocabulary, against a "
                    "one-device mesh: " + _CI_TIME,
    "test_multihost.py": "processes joined into one mesh, a follower killed: " + _CI_TIME,
    "test_native_attention.py": "the reference-core engine only gives the expected "
                                "tokens; the default-core engine beside it warms up",
    "test_pallas_attention.py": "interpreted Pallas kernels: compiling every serving "
                                "program in interpret mode costs minutes",
    "test_plan_decode.py": "an engine built for its decode runner, shut down before any "
                           "request",
    "test_prefill_cache.py": _PREFIX,
    "test_prefix_cache.py": _PREFIX,
    "test_prefix_first_repeat.py": "an engine built to list its serving programs, no "
                                   "request served; the chats test beside it runs at the "
                                   "defaults",
    "test_quant.py": "float and quantized engines compared to each other: " + _CI_TIME,
    "test_quant_dot.py": "int8 activations against float: " + _CI_TIME,
    "test_role_switch.py": "an engine rebuilt for each role it switches to: " + _CI_TIME,
    "test_sampling_options.py": "sampling options and their wire form: " + _CI_TIME,
    "test_server_fuzz.py": "malformed requests against a module engine: " + _CI_TIME,
    "test_warmup.py": "about warm-up: a cold engine against a warmed one",
}


def test_every_cold_test_says_why():
    """A file that serves without warm-up is listed in `COLD_TESTS` with its reason,
    and a listed file still does (a stale entry is an error too)."""
    import re

    cold = re.compile(r"warmup\s*=\s*False|--nowarmup")
    tests = os.path.join(ROOT, "tests")
    found = set()
    for dirpath, _, files in os.walk(tests):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.endswith(".py") or path == os.path.abspath(__file__):
                continue
            with open(path) as f:
                if cold.search(f.read()):
                    found.add(os.path.relpath(path, tests).replace(os.sep, "/"))
    assert sorted(found - COLD_TESTS.keys()) == [], "cold without a reason in COLD_TESTS"
    assert sorted(COLD_TESTS.keys() - found) == [], "stale: no longer cold"
    assert all(reason.strip() for reason in COLD_TESTS.values())
