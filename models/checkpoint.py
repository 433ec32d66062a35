"""Loading a model, and orbax save/restore of converted params.

`load(path)` accepts a Hugging Face checkpoint directory (config.json + safetensors
[+ tokenizer.json]), a directory written by `save_converted` (config.json + an orbax
`params/` checkpoint) or a GGUF file (dequantized on load), and places every weight
straight onto the shardings it is given.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxpd.models.config import ModelConfig
from jaxpd.models import source
from jaxpd.models.hf_io import DTYPES, load_hf_params, tree_get, tree_set
from jaxpd.models.layout import abstract_params
from jaxpd.models.tokenizer import Tokenizer

_log = logging.getLogger(__name__)

ORBAX_DIR = "params"


@dataclasses.dataclass
class LoadedModel:
    path: str
    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    dtype: str
    # (weight elements this process read, elements the model has), for a Hugging Face
    # checkpoint; a process that holds only some shards reads only those.
    weights_read: tuple[int, int] | None = None
    # How the weights are held: "none", "int8", or "gguf" (a GGUF file's block formats
    # kept as stored), what `source.QUANTIZATIONS` asked for resolved.
    quantization: str = "none"


def may_keep_quantized(path: str, quantization: str) -> bool:
    """Whether `load(path, quantization=quantization)` may serve quantized weights:
    `int8`, or a GGUF file under `auto` (which keeps its blocks, unless a tensor is in
    a type it cannot keep)."""
    return quantization == "int8" or \
        (quantization == "auto" and source.is_gguf(source.checkpoint_path(path)))


def load(path: str, dtype: str = "float32", shardings=None,
         quantization: str = "none") -> LoadedModel:
    """Load config, params (onto `shardings`, a tree like params or a function of the
    `ModelConfig` that gives one; else the default device) and tokenizer (None when the
    directory has no tokenizer.json). With shardings, a safetensors or orbax checkpoint
    is read one addressable shard at a time: each process reads only its own.
    `quantization`: one of `source.QUANTIZATIONS`; quantized weights are placed as their
    float weights would be (`quant.shardings_like`)."""
    if quantization not in source.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {source.QUANTIZATIONS}, "
                         f"got {quantization!r}")
    path = source.checkpoint_path(path)
    if source.is_gguf(path):
        if callable(shardings):
            shardings = shardings(_gguf_config(path))
        model = _load_gguf(path, dtype, shardings, keep=quantization == "auto")
        return _int8(model, shardings) if quantization == "int8" else model
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_dir(path)
    if callable(shardings):
        shardings = shardings(cfg)
    shapes, _ = abstract_params(cfg, DTYPES.get(dtype, jnp.float32))
    read = None
    if os.path.isdir(os.path.join(path, ORBAX_DIR)):
        params = restore_params(os.path.join(path, ORBAX_DIR), cfg, dtype, shardings)
    else:
        log: list = []
        params = load_hf_params(path, cfg, dtype, shardings,
                                jax.tree.map(lambda s: s.shape, shapes), read_log=log)
        read = (sum(n for _, n in log), sum(s.size for s in jax.tree.leaves(shapes)))
    tokenizer = Tokenizer(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    model = LoadedModel(path, cfg, params, tokenizer, dtype, read)
    return _int8(model, shardings) if quantization == "int8" else model


def _int8(model: LoadedModel, shardings) -> LoadedModel:
    """`model` with its projections and embeddings quantized to int8 where they lie."""
    from jaxpd.models import quant
    from jaxpd.models.layout import quantize_params

    params = jax.jit(quantize_params)(model.params)
    if shardings is not None:
        params = quant.place(params, shardings)
    return dataclasses.replace(model, params=params, quantization="int8")


def _gguf_config(path: str) -> ModelConfig:
    from jaxpd.models import gguf

    return gguf.model_config(gguf.GGUFFile(path))


def _load_gguf(path: str, dtype: str, shardings, keep: bool = False) -> LoadedModel:
    from jaxpd.models import gguf   # the gguf package only for GGUF files
    from jaxpd.models import quant

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    f = gguf.GGUFFile(path)
    cfg, tokenizer = gguf.model_config(f), gguf.tokenizer(f)
    unkept = gguf.unkept_tensor(f, cfg) if keep else None
    if unkept is not None:
        # "auto" keeps only what it serves as stored; anything else is served as float.
        _log.warning("quantization=auto: tensor %r is %s, which is not served kept "
                     "quantized; the whole file is dequantized to float", *unkept)
        keep = False
    floats = gguf.float_served_quantized(f, cfg) if keep else []
    if floats:
        # Kept block formats serve projections and stacked experts: routers and shared
        # experts run as float.
        _log.warning("quantization=auto: %d router or shared-expert tensors (%r is %s, "
                     "...) are not served kept quantized; they are "
                     "dequantized to float at load, the other projections and experts stay "
                     "quantized", len(floats), *floats[0])
    shapes, _ = abstract_params(cfg, DTYPES[dtype])
    params: dict = {}
    kept = False
    names = gguf.tensor_names(cfg)
    for ours, w in gguf.weights(f, cfg, keep_quantized=keep):
        want = tree_get(shapes, ours).shape
        got = w.float_shape if quant.is_quantized(w) else w.shape
        if tuple(got) != tuple(want):
            raise ValueError(f"{path}: tensor {names[ours]!r} (weight {'/'.join(ours)}) has "
                             f"shape {tuple(got)} after conversion, expected {tuple(want)} "
                             f"from the metadata")
        sharding = tree_get(shardings, ours)
        if quant.is_quantized(w):
            kept = True
            w = (quant.place(w, sharding) if sharding is not None
                 else jax.tree.map(jnp.asarray, w))
        else:
            w = w.astype(DTYPES[dtype])
            w = jax.device_put(w, sharding) if sharding is not None else jnp.asarray(w)
        tree_set(params, ours, w)
    return LoadedModel(path, cfg, params, tokenizer, dtype,
                       quantization="gguf" if kept else "none")


def save_params(params, path: str) -> None:
    """Save a params tree with orbax (overwrites `path`)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        shutil.rmtree(path)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params)
        ckpt.wait_until_finished()


def restore_params(path: str, cfg: ModelConfig, dtype: str = "float32", shardings=None):
    """Restore an orbax params checkpoint straight into `shardings` (no host round trip
    through a default device)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    shapes, _ = abstract_params(cfg, DTYPES[dtype])
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(os.path.abspath(path), target)
