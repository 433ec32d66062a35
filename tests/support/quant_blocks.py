"""Quantized weights of random blocks, and the native products called directly, for
tests of `models.quant`'s kernels."""
import gguf
import jax
import jax.numpy as jnp
import numpy as np

from jaxpd.models import kquant, quant
from tests.support.gguf_files import random_k_blocks

Q = gguf.GGMLQuantizationType


def random_blocks(fmt: str, rows: int, cols: int, rng) -> quant.QuantizedWeight:
    """A [cols -> rows] weight of random blocks in a GGUF format, small float16 scales.
    The K-quants (`q4_k`, `q6_k`): random GGUF super-blocks read as the loader reads
    them, cut to `cols` (any multiple of 32; the kernels take any)."""
    if fmt in ("q4_k", "q6_k"):
        return _random_k(fmt, rows, cols, rng)
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(0.005, 0.02, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if fmt == "q4_1":
        raw[:, :, 2:4] = rng.uniform(-0.1, 0.0, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    parts = quant.from_gguf_rows(raw.reshape(-1), fmt, rows, cols, "w")
    return quant.QuantizedWeight(*(None if a is None else jnp.asarray(a) for a in parts),
                                 fmt=fmt, float_shape=(cols, rows), in_dims=(0,))


def _random_k(fmt: str, rows: int, cols: int, rng) -> quant.QuantizedWeight:
    qtype = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K}[fmt]
    whole = -(-cols // kquant.SUPER) * kquant.SUPER
    raw = random_k_blocks(rows, whole, qtype, rng)
    got, data, scale, low = kquant.from_gguf_k_rows(raw.reshape(-1), qtype.name, rows, whole, "w")
    assert got == fmt
    per = {"data": cols // 2 if fmt == "q4_k" else cols,
           "scale": cols // (32 if fmt == "q4_k" else 16)}
    parts = (data[:, :per["data"]], scale[:, :per["scale"]],
             None if low is None else low[:, :per["scale"]])
    return quant.QuantizedWeight(*(None if a is None else jnp.asarray(np.ascontiguousarray(a))
                                   for a in parts),
                                 fmt=fmt, float_shape=(cols, rows), in_dims=(0,))


def random_weight(fmt: str, rows: int, cols: int, rng) -> quant.QuantizedWeight:
    """`random_blocks`, or for `int8` a random float weight quantized per channel."""
    if fmt == "int8":
        return quant.quantize_int8(rng.normal(size=(cols, rows)).astype(np.float32), (0,))
    return random_blocks(fmt, rows, cols, rng)


def kernel_call(target: str):
    """x @ w through the native kernel registered as `target` (either product's FFI
    signature), at any number of rows."""
    def call(x, w):
        o = int(np.prod(w.out_shape))
        low = w.min if w.min is not None else w.scale
        fn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], o), jnp.float32))
        return fn(x, w.data.reshape(o, -1), w.scale.reshape(o, -1), low.reshape(o, -1),
                  jnp.int32(0), fmt=quant._FMT_CODES[w.fmt])
    return call


def greedy_kept_and_float(path: str, prompts: list[str], num_new: int, check=None) -> dict:
    """Greedy tokens of `prompts` from the GGUF file `path`, read as float ("none") and
    kept ("auto"), all at once on `prefill=1,decode=1` with sixteen decode slots, so steps
    take the native product at one row and at 9 to 16 (its panel form). `check(llm)`
    runs on the kept engine before it shuts down."""
    from jaxpd import LLM, SamplingParams

    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    outs = {}
    for quantization in ("none", "auto"):
        with LLM(model=path, mesh="prefill=1,decode=1", quantization=quantization,
                 max_prefill_batch=16, slots_per_shard=16, warmup=False) as llm:
            outs[quantization] = [list(o.token_ids) for o in llm.generate(prompts, params)]
            assert 16 in llm.engine.decode_loop.batch_sizes
            if quantization == "auto" and check is not None:
                check(llm)
    return outs
