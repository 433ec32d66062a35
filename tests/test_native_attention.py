"""The native (C++, jax.ffi) paged decode attention against the `jnp` reference: the
kernel alone, inside the engine on dp and dp x tp decode meshes, its build and cache,
page ids outside the pool, and the `attention_impl` choice around it."""
import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.config import resolve_attention_impl
from jaxpd.models import native_attention
from jaxpd.engine.programs.kernels import prefill_attention
from jaxpd.models.attention import causal_attention, paged_attention
from jaxpd.models.native_attention import paged_attention_native
from tests.engine_fixtures import XlaCompiles, assert_all_pages_free

pytestmark = pytest.mark.skipif(native_attention._compiler() is None,
                                reason="no C++ compiler on this machine")


def test_kernel_builds_where_a_compiler_is_found():
    # With a compiler present, a build failure is a bug, not a silent fallback.
    assert native_attention.available(), native_attention.unavailable_reason()


def test_attention_library_leaves_the_quantized_products_out():
    # A float model's cold start builds only what it runs: the quantized products are
    # a library of their own, built when quantized weights ask for them.
    assert native_attention.available()
    attention = native_attention._build(sources=native_attention._ATTENTION_SOURCES)
    library = ctypes.cdll.LoadLibrary(str(attention))
    assert hasattr(library, "JaxpdPagedDecodeF32") and not hasattr(library, "JaxpdQuantDot")
    assert set(native_attention._ATTENTION_SOURCES).isdisjoint(native_attention._QUANT_SOURCES)
    assert native_attention.quant_available()
    quant = ctypes.cdll.LoadLibrary(str(native_attention._build(
        sources=native_attention._QUANT_SOURCES)))
    assert hasattr(quant, "JaxpdQuantMatmul") and hasattr(quant, "JaxpdQuantDot")


def _pools(seed, *, layers=3, num_pages=13, page_size=4, kh=2, h=16):
    rng = np.random.default_rng(seed)
    shape = (layers, num_pages, page_size, kh, h)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


@functools.cache
def _portable_kernel():
    """The kernel built without AVX-512 (its portable body), under its own FFI target;
    None where this CPU has no AVX-512 (the default build is then that body already)."""
    if "avx512f" not in native_attention._cpu_identity().split():
        return None
    library = ctypes.cdll.LoadLibrary(str(native_attention._build(("-mno-avx512f",))))
    jax.ffi.register_ffi_target("jaxpd_paged_decode_f32_portable",
                                jax.ffi.pycapsule(library.JaxpdPagedDecodeF32), platform="cpu")

    def call(q, k_pool, v_pool, layer, tables, lengths):
        fn = jax.ffi.ffi_call("jaxpd_paged_decode_f32_portable",
                              jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return fn(q, k_pool, v_pool, tables, lengths, jnp.asarray(layer, jnp.int32))
    return call


@pytest.mark.parametrize("body", ["built", "portable"])
@pytest.mark.parametrize("kh,g,h,page_size", [(2, 2, 16, 4), (1, 4, 32, 16), (4, 1, 8, 2),
                                              (3, 3, 64, 8), (2, 2, 128, 4), (2, 2, 32, 32),
                                              (4, 2, 32, 16)])
def test_kernel_equals_reference_on_every_layer(kh, g, h, page_size, body):
    """Both bodies of the kernel (the AVX-512 one where this CPU has it, and the portable
    one) against the reference: head dims 8-128, pages of 2-32 tokens, grouped heads."""
    kernel = paged_attention_native
    if body == "portable":
        kernel = _portable_kernel()
        if kernel is None:
            pytest.skip("no AVX-512 here: the built kernel is the portable body")
    rng = np.random.default_rng(kh * 100 + g)
    b, width, num_pages = 7, 5, 17
    k, v = _pools(g, num_pages=num_pages, page_size=page_size, kh=kh, h=h)
    q = jnp.asarray(rng.standard_normal((b, kh * g, h)), jnp.float32)
    tables = rng.integers(0, num_pages, (b, width))
    tables[0] = tables[1]                                  # slots sharing pages
    tables[2, 2:] = 0                                      # a tail of null pages
    lengths = rng.integers(1, width * page_size + 1, b)
    lengths[:3] = 1, width * page_size, 2 * page_size
    lengths[3] = width * page_size + 9                     # past the table: all keys count
    tables, lengths = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    native = jax.jit(kernel, static_argnums=3)
    for layer in range(k.shape[0]):
        expected = paged_attention(q, k[layer], v[layer], tables, lengths)
        np.testing.assert_allclose(native(q, k, v, layer, tables, lengths), expected,
                                   atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("b,t,kh,g,h", [(1, 100, 4, 2, 32), (3, 33, 2, 2, 64), (2, 256, 3, 3, 64),
                                         (1, 40, 1, 4, 128), (2, 17, 4, 1, 32), (1, 1, 2, 2, 32),
                                         (1, 257, 3, 3, 64), (2, 255, 2, 1, 128), (1, 65, 1, 5, 32),
                                         (3, 15, 2, 2, 64), (1, 130, 1, 7, 128), (2, 64, 3, 1, 64)])
def test_prefill_kernel_equals_reference(b, t, kh, g, h):
    """The native causal attention of a prompt against `causal_attention` (query blocks of
    the reference; in the kernel, tasks of 64, 32 or 16 positions as G grows, their G
    heads stacked as the rows of one tile, tiles of up to 6 rows for scores and
    24 / (H / 16) for values, key blocks of 64, the causal mask only on the blocks that
    cross a row's position): prompts shorter than, equal to and past multiples of 16, 32
    and 64 (1, 15, 17, 33, 65, 255, 257), rows left over from every tile width, batches,
    grouped heads (1-7: every task size), head dims 32-128."""
    if not native_attention.prefill_available(h):
        pytest.skip("no AVX-512 here: prefill stays on the reference")
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    got = jax.jit(native_attention.causal_attention_native)(q, k, v)
    np.testing.assert_allclose(got, causal_attention(q, k, v), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("b,t,kh,g,h,page_size,width", [
    (3, 40, 2, 2, 32, 4, 9), (2, 17, 1, 3, 64, 16, 3), (1, 1, 2, 1, 128, 8, 2),
    (4, 70, 2, 3, 64, 16, 9), (4, 33, 1, 2, 128, 8, 17)])
def test_prefix_kernel_equals_gathering_the_prefix_for_the_reference(b, t, kh, g, h,
                                                                     page_size, width):
    """A prefill with context's attention read in place from the pool, against the
    reference over the gathered prefix: prefixes of no page, part of a block of 64
    keys, exactly one block, several blocks and a part, the whole table and more than it
    (the table's keys count), page ids past the pool and negative (read as jnp's gather
    reads them), each layer of the pool."""
    if not native_attention.prefill_available(h):
        pytest.skip("no AVX-512 here: prefill stays on the reference")
    from jaxpd.models.attention import gather_pages
    rng = np.random.default_rng(t)
    k_pool, v_pool = _pools(t, num_pages=11, page_size=page_size, kh=kh, h=h)
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32) for _ in range(2))
    tables = rng.integers(0, 11, (b, width))
    tables[0, 0], tables[-1, -1] = 13, -2                 # past the pool, from its end
    lengths = rng.integers(0, width * page_size + 1, b)
    lengths[0] = 0 if b > 1 else width * page_size + 5    # none, or past the table
    if b > 2:
        lengths[1:3] = 3, width * page_size
    if b > 3:
        lengths[3] = 64
    tables, lengths = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    native = jax.jit(native_attention.prefix_attention_native)
    reference = jax.jit(lambda q, k, v, kp, vp, layer, tables, lengths: causal_attention(
        q, k, v, (gather_pages(kp, layer, tables), gather_pages(vp, layer, tables), lengths)))
    for layer in range(k_pool.shape[0]):
        args = (q, k, v, k_pool, v_pool, jnp.int32(layer), tables, lengths)
        np.testing.assert_allclose(native(*args), reference(*args), atol=2e-6, rtol=2e-5)


def test_prefill_attention_choice():
    """The engine's prefill runs the native kernel only for "native" and a head dim it
    is written for (on a CPU with AVX-512); everything else gets the reference."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    assert prefill_attention("reference", mesh, (), 32) is causal_attention
    assert prefill_attention("pallas_gpu", mesh, (), 32) is causal_attention
    assert prefill_attention("native", mesh, (), 16) is causal_attention
    native = prefill_attention("native", mesh, (), 32)
    assert (native is causal_attention) == (not native_attention.prefill_available(32))
    with pytest.raises(RuntimeError, match="needs AVX-512 and head dim 32, 64 or 128"):
        native_attention.causal_attention_native(*(jnp.zeros((1, 4, 2, 16)),) * 3)


def test_a_page_id_outside_the_pool_is_read_as_the_reference_reads_it():
    """jnp's gather counts a negative index from the end and clamps the rest into the
    array: the kernel does the same, so it never reads outside the pool and agrees with
    the reference whatever a table holds."""
    k, v = _pools(0)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4, 16)), jnp.float32)
    lengths = jnp.asarray([3, 5, 8], jnp.int32)
    for bad in (13, -1, -13, -14, 2 ** 30, -2 ** 31):
        tables = jnp.asarray([[1, 2], [4, bad], [bad, bad]], jnp.int32)
        out = jax.block_until_ready(paged_attention_native(q, k, v, 1, tables, lengths))
        np.testing.assert_allclose(out, paged_attention(q, k[1], v[1], tables, lengths),
                                   atol=2e-6, rtol=2e-5, err_msg=f"page id {bad}")


def test_build_is_cached_per_source_and_reports_a_failed_compiler(tmp_path, monkeypatch):
    # A stand-in compiler that logs each call and writes its -o file: the caching is
    # what is checked here (every other test here loads a library really compiled).
    log = tmp_path / "builds.log"
    compiler = tmp_path / "fake-c++"
    compiler.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "fake c++ 1"; exit 0; fi
echo "$@" >> {log}
while [ $# -gt 1 ]; do if [ "$1" = -o ]; then echo library > "$2"; fi; shift; done
""")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path))
    path = native_attention._build()
    assert path.parent == tmp_path / "native" and path.read_text() == "library\n"
    # One object a source (compiled at once), then one link of them all.
    calls = log.read_text().splitlines()
    sources = native_attention._SOURCES
    assert len(calls) == len(sources) + 1
    assert sorted(c.split(" -c ")[1].split()[0] for c in calls[:-1]) == \
        sorted(map(str, sources))
    assert calls[-1].startswith("-shared") and calls[-1].count(".o") == len(sources)
    assert native_attention._build() == path and len(log.read_text().splitlines()) == len(calls)
    assert native_attention._build(("-mno-avx512f",)) != path      # other flags: another key
    assert len(log.read_text().splitlines()) == 2 * len(calls)
    assert not [p for p in (tmp_path / "native").iterdir() if p.suffix != ".so"]
    monkeypatch.setenv("JAXPD_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "false")                   # a compiler that always fails
    with pytest.raises(RuntimeError, match="false failed"):
        native_attention._build()
    assert not any(p.suffix == ".so" for p in (tmp_path / "other" / "native").iterdir())


def test_prebuild_builds_once_on_its_own_thread(monkeypatch):
    # `available()` during a prebuild waits for it: the library loads once.
    import threading
    calls, started, release = [], threading.Event(), threading.Event()

    def slow_load():
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return True, ""

    monkeypatch.setattr(native_attention, "_load_once", slow_load)
    native_attention.prebuild()
    assert started.wait(10)
    waiter = threading.Thread(target=native_attention.available)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and calls == ["jaxpd-native-build"]
    release.set()
    waiter.join(10)
    assert not waiter.is_alive() and len(calls) == 2       # (the stand-in is not cached)


def test_prebuild_starts_only_the_libraries_the_engine_will_ask_for(monkeypatch):
    from jaxpd.config import prebuild_native
    asked = []
    monkeypatch.setattr(native_attention, "prebuild", lambda **kw: asked.append(kw))
    prebuild_native("auto", "cpu", "float32", quantized=True)
    prebuild_native("reference", "cpu", "float32", quantized=False)
    assert asked == [{"attention": True, "quantized": True},
                     {"attention": False, "quantized": False}]
    prebuild_native("auto", "cpu", "bfloat16", quantized=True)     # neither serves bfloat16
    prebuild_native("auto", "tpu", "float32", quantized=True)
    assert len(asked) == 2


def test_jaxlib_older_than_the_kernel_has_served_with_gets_the_reference():
    assert native_attention.version_refusal("0.6.0") == "needs jaxlib >= 0.10, found 0.6.0"
    assert native_attention.version_refusal("0.9.2") is not None
    assert native_attention.version_refusal("0.10.2") is None
    assert native_attention.version_refusal("1.0.0.dev20270101") is None


def test_attention_impl_choice(monkeypatch):
    assert resolve_attention_impl("auto", "cpu") == "native"
    assert resolve_attention_impl("native", "cpu") == "native"
    assert resolve_attention_impl("auto", "cpu", dtype="bfloat16") == "reference"
    with pytest.raises(ValueError, match="serves float32 only, not dtype='bfloat16'"):
        resolve_attention_impl("native", "cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="runs on CPU devices only, not gpu"):
        resolve_attention_impl("native", "cuda")
    with pytest.raises(ValueError, match="attention_interpret=True needs a Pallas"):
        resolve_attention_impl("native", "cpu", interpret=True)
    # Where it cannot be built: "auto" falls back, an explicit request says why.
    monkeypatch.setattr(native_attention, "_load", lambda: (False, "no C++ compiler found"))
    assert resolve_attention_impl("auto", "cpu") == "reference"
    with pytest.raises(ValueError, match=r"could not be built here: no C\+\+ compiler found"):
        resolve_attention_impl("native", "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [pytest.param("prefill=1,decode=2", marks=pytest.mark.matrix),
                                  "prefill=2,decode=2x2"])
def test_engine_tokens_equal_the_reference(mesh, monkeypatch):
    """Greedy tokens of the built-in model's engine at the defaults ("auto" = native,
    warm-up and kept executables on, no program compiled by a request) equal the
    reference core's, on a dp decode mesh and a dp x tp one (kv heads split over tp),
    across page boundaries. (test_engine holds the default engine to transformers'
    tokens on every mesh.)"""
    prompts = ["def foo(x):", "The list type", "import os\nimport sys\n" * 6, "a"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
    tokens = {}
    for impl in ("auto", "reference"):
        # The reference engine only gives the expected tokens: compiled as it serves.
        cold = {} if impl == "auto" else dict(warmup=False)
        with LLM(mesh=mesh, max_model_len=160, slots_per_shard=2, attention_impl=impl,
                 **cold) as llm, XlaCompiles(on_request_threads=True) as xla:
            assert llm.engine.decode_runner.attention_impl == ("native" if impl == "auto"
                                                               else "reference")
            tokens[impl] = [o.token_ids for o in llm.generate(prompts, params)]
            assert_all_pages_free(llm)
        assert impl == "reference" or xla.count == 0
    assert tokens["auto"] == tokens["reference"]
    assert all(len(t) == 40 for t in tokens["auto"])


def test_a_failed_build_falls_back_with_one_line_naming_why(monkeypatch, caplog):
    """No compiler (or a failed build, or no AVX-512 for the prompt kernel): the
    portable forms serve, and one log line says why; nothing raises at start."""
    def no_compiler(**_):
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")

    monkeypatch.setattr(native_attention, "_build", no_compiler)
    with caplog.at_level("WARNING", logger="jaxpd.models.native_attention"):
        ok, reason = native_attention._registered(native_attention._QUANT_SOURCES,
                                                  lambda library: [])
    assert not ok and "no C++ compiler" in reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "quantized products" in lines[0] and "no C++ compiler" in lines[0]
