"""Native kernels for XLA:CPU: paged decode attention (`attention_impl="native"`,
`native/paged_attention.cc`), on CPUs with AVX-512 the causal attention of a prompt
(`native/causal_prefill.cc`; elsewhere prefill stays on the jnp reference), and the two
products of quantized weights (`models.quant`: `native/quant_matmul.cc`, float
activations; `native/quant_dot.cc`, activations quantized to int8).

The sources are compiled into two libraries with the system's C++ compiler the first time
each is needed (the attention kernels, `available()`; the quantized products, only for
quantized weights, `quant_available()`), against the XLA FFI headers of the *installed*
jaxlib (so the handler always matches the runtime it registers with), one compiler
process a source, and cached in `$JAXPD_CACHE/native` (`jaxpd.paths`) under a name that
hashes the sources, the jaxlib version, the compiler and this CPU. No compiler, or a
failed build: `available()` is False with the reason in `unavailable_reason()`, and
"auto" stays on the jnp reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpd import paths

_log = logging.getLogger(__name__)
_NATIVE = Path(__file__).parent / "native"
_ATTENTION_SOURCES = (_NATIVE / "paged_attention.cc", _NATIVE / "causal_prefill.cc")
# The quantized products (`models.quant`): a float model never builds them.
_QUANT_SOURCES = (_NATIVE / "quant_matmul.cc", _NATIVE / "quant_dot.cc")
_SOURCES = _ATTENTION_SOURCES + _QUANT_SOURCES
_HEADERS = (_NATIVE / "common.h", _NATIVE / "quant_common.h")
# The oldest jaxlib it has served with. With jaxlib 0.6.0 (`.ci/min_versions`) it built
# but a decode worker process failed its requests, not yet understood: older ones use
# the reference.
MIN_JAXLIB = (0, 10)
_TARGET = "jaxpd_paged_decode_f32"
_PREFILL_TARGET = "jaxpd_causal_prefill_f32"
_PREFIX_TARGET = "jaxpd_prefix_prefill_f32"
QUANT_MATMUL_TARGET = "jaxpd_quant_matmul"
QUANT_DOT_TARGET = "jaxpd_quant_dot"
_registered_targets: set[str] = set()     # the FFI targets this process has registered
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17",
          "-shared", "-fPIC", "-w")


def _cache_dir() -> Path:
    return Path(paths.native_dir())


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags: `-march=native` code built on one host
    must not be loaded on another (a shared home directory across unlike machines;
    virtual machines often share a generic model name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags"):
            first.setdefault(key, line)
    return "\n".join(first.values()) or platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or \
        shutil.which("clang++")


def _build(extra_flags: tuple[str, ...] = (), sources: tuple[Path, ...] = _SOURCES) -> Path:
    """The compiled library's path, building it if this machine has none yet
    (`extra_flags`: e.g. `-mno-avx512f` for the portable body, as a test builds it;
    `sources`: a subset of the kernels, as a test of one kernel's body builds it)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    import jaxlib
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([
        *(f.read_text() for f in (*sources, *_HEADERS)), jaxlib.__version__, compiler,
        *version, *_FLAGS, *extra_flags, _cpu_identity()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside and renamed: processes building at once never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objects:
            compile_flags = [f for f in (*_FLAGS, *extra_flags) if f != "-shared"]
            # One compiler process a source, all at once: a cold start waits for the
            # build, and one process would keep only one core busy.
            commands = [[compiler, *compile_flags, "-I", jax.ffi.include_dir(), "-c",
                         str(source), "-o", os.path.join(objects, f"{i}-{source.stem}.o")]
                        for i, source in enumerate(sources)]
            _run_all(compiler, commands)
            _run_all(compiler, [[compiler, "-shared", "-fPIC", *(c[-1] for c in commands),
                                 "-o", tmp]])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _run_all(compiler: str, commands: list[list[str]]) -> None:
    """Run `commands` at once; a failed one raises with its error output."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    failed = None
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = stderr
    if failed is not None:
        raise RuntimeError(f"{compiler} failed: {failed.strip()[:2000]}")


def version_refusal(version: str) -> str | None:
    """Why jaxlib `version` gets the reference instead, or None."""
    found = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if found < MIN_JAXLIB:
        return f"needs jaxlib >= {'.'.join(map(str, MIN_JAXLIB))}, found {version}"
    return None


def prebuild(attention: bool = True, quantized: bool = False) -> None:
    """Build and register the attention library (and, `quantized`, the products') on
    threads of their own, so that a cold start builds them while the caller loads
    weights; the first `available()` (`quant_available()`) waits for its build."""
    for wanted, load in ((attention, _load), (quantized, _load_quant)):
        if wanted:
            threading.Thread(target=load, name="jaxpd-native-build", daemon=True).start()


# Held while a thread loads a library: a caller asking meanwhile waits for it.
_loading, _loading_quant = threading.Lock(), threading.Lock()


def _load() -> tuple[bool, str]:
    """(whether the attention kernels are built and registered, why not), built once."""
    with _loading:
        return _load_once()


def _load_quant() -> tuple[bool, str]:
    """The same for the quantized products."""
    with _loading_quant:
        return _load_quant_once()


def _registered(sources: tuple[Path, ...], targets) -> tuple[bool, str]:
    """Build the library of `sources` and register `targets(library)`'s (name,
    symbol) pairs: (whether it did, why not)."""
    import jaxlib
    refusal = version_refusal(jaxlib.__version__)
    if refusal is not None:
        return False, refusal
    kind = "quantized products" if _QUANT_SOURCES[0] in sources else "attention kernels"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(sources=sources)))
        for name, symbol in targets(library):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
            _registered_targets.add(name)
    except Exception as e:   # noqa: BLE001 - any failure means: use the reference
        reason = f"{type(e).__name__}: {e}"
        _log.warning("jaxpd: the native CPU %s could not be built or loaded, so the "
                     "portable jnp forms serve: %s", kind, reason.splitlines()[0][:300])
        return False, reason
    if sources == _ATTENTION_SOURCES and _PREFILL_TARGET not in _registered_targets:
        _log.info("jaxpd: this CPU has no AVX-512, so prompts' attention runs the portable "
                  "jnp form (the native decode kernel serves)")
    return True, ""


def _attention_targets(library) -> list:
    found = [(_TARGET, library.JaxpdPagedDecodeF32)]
    if hasattr(library, "JaxpdCausalPrefillF32"):      # built where AVX-512 is
        found += [(_PREFILL_TARGET, library.JaxpdCausalPrefillF32),
                  (_PREFIX_TARGET, library.JaxpdPrefixPrefillF32)]
    return found


@functools.cache
def _load_once() -> tuple[bool, str]:
    return _registered(_ATTENTION_SOURCES, _attention_targets)


@functools.cache
def _load_quant_once() -> tuple[bool, str]:
    return _registered(_QUANT_SOURCES, lambda library: [
        (QUANT_MATMUL_TARGET, library.JaxpdQuantMatmul),
        (QUANT_DOT_TARGET, library.JaxpdQuantDot)])


def available() -> bool:
    """Whether the attention kernels are built and registered (building them on first
    call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def quant_available() -> bool:
    """Whether the quantized products (`models.quant`) are built and registered
    (building them on first call)."""
    return _load_quant()[0]


def quant_unavailable_reason() -> str:
    return _load_quant()[1]


def paged_attention_native(q_BNH: jnp.ndarray, k_pool_LPSKH: jnp.ndarray,
                           v_pool_LPSKH: jnp.ndarray, layer, block_tables: jnp.ndarray,
                           lengths: jnp.ndarray) -> jnp.ndarray:
    """`attention.paged_attention` on layer `layer` of the whole pools (read in place):
    q [B, N, H] float32, pools [L, P, page_size, K, H] float32 -> [B, N, H]. `layer`
    is data (an int or a traced int32 scalar, as a scan over layers has it)."""
    if not available():
        raise RuntimeError(f"the native attention kernel is not available: "
                           f"{unavailable_reason()}")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q_BNH.shape, jnp.float32))
    return call(q_BNH, k_pool_LPSKH, v_pool_LPSKH, block_tables.astype(jnp.int32),
                lengths.astype(jnp.int32), jnp.asarray(layer, jnp.int32))


# The decode model passes this kernel the whole pools and the layer (`Llama.decode`).
paged_attention_native.whole_pool = True

# Head dims the prefill kernel is written for (register tiles of 16 floats).
PREFILL_HEAD_DIMS = (32, 64, 128)


def prefill_available(head_dim: int) -> bool:
    """Whether `causal_attention_native` serves prompts of this head dim here: the
    library built, with its AVX-512 prefill kernel (this CPU has AVX-512)."""
    return available() and _PREFILL_TARGET in _registered_targets and \
        head_dim in PREFILL_HEAD_DIMS


def causal_attention_native(q_BTNH: jnp.ndarray, k_BTKH: jnp.ndarray,
                            v_BTKH: jnp.ndarray) -> jnp.ndarray:
    """`attention.causal_attention` without a prefix: q [B, T, N, H], k, v [B, T, K, H]
    float32 -> [B, T, N, H]."""
    if not prefill_available(q_BTNH.shape[-1]):
        raise RuntimeError("the native prefill kernel is not available here (it needs "
                           "AVX-512 and head dim 32, 64 or 128)")
    call = jax.ffi.ffi_call(_PREFILL_TARGET, jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32))
    return call(q_BTNH, k_BTKH, v_BTKH)


def prefix_attention_native(q_BTNH: jnp.ndarray, k_BTKH: jnp.ndarray, v_BTKH: jnp.ndarray,
                            k_pool_LPSKH: jnp.ndarray, v_pool_LPSKH: jnp.ndarray, layer,
                            prefix_tables_BW: jnp.ndarray, prefix_len_B: jnp.ndarray
                            ) -> jnp.ndarray:
    """`attention.causal_attention` after a cached prefix (no window, no softcap), the
    prefix read in place from layer `layer` of the whole pools: row b's first
    prefix_len[b] keys of the pages `prefix_tables[b]` (what `attention.gather_pages`
    would gather), then its own causal keys. q [B, T, N, H], k, v [B, T, K, H], pools
    [L, P, page_size, K, H], all float32 -> [B, T, N, H]. `layer` is data (an int or a
    traced int32, as a scan over layers has it); a prefix length past the table counts
    the table's keys, as the reference's mask does."""
    if not prefill_available(q_BTNH.shape[-1]):
        raise RuntimeError("the native prefill kernel is not available here (it needs "
                           "AVX-512 and head dim 32, 64 or 128)")
    call = jax.ffi.ffi_call(_PREFIX_TARGET, jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32))
    return call(q_BTNH, k_BTKH, v_BTKH, k_pool_LPSKH, v_pool_LPSKH,
                prefix_tables_BW.astype(jnp.int32), prefix_len_B.astype(jnp.int32),
                jnp.asarray(layer, jnp.int32))
