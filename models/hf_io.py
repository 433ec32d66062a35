"""Hugging Face checkpoint <-> params tree.

Reads `model.safetensors` or a sharded `model.safetensors.index.json`; writes a single
`model.safetensors` (used to ship the default model and to hand our weights to
transformers in tests). Every missing file, missing tensor or wrong shape is a
`ValueError`/`FileNotFoundError` naming it.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpd.models.config import ModelConfig

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _rows(s: slice, dim: int, per: int) -> slice:
    """The HF rows (or columns) of our slice `s` of a dimension of `dim` blocks, each
    `per` HF rows long (a head of `per` = head_dim rows)."""
    start, stop, _ = s.indices(dim)
    return slice(start * per, stop * per)


def _mapping(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], str, Callable, Callable,
                                                  Callable]]:
    """(our path, HF name, HF array -> ours, ours -> HF array, read) for every weight.

    `read(tensor, index)`: our array's `index` (a tuple of slices, as
    `jax.make_array_from_callback` asks) read from `tensor` (a safetensors slice handle)
    without reading the rest: a process of a mesh spanning several reads only the
    shards it holds."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda w: w, lambda w: w, lambda t, i: t[i])
    transpose = (lambda w: w.T, lambda w: w.T, lambda t, i: t[i[1], i[0]].T)

    def proj_in(heads):   # torch Linear [heads*H, D] <-> ours [D, heads, H]
        def read(t, i):
            x = t[_rows(i[1], heads, h), i[0]]                  # [heads' * H, D']
            return x.T.reshape(x.shape[1], -1, h)[:, :, i[2]]
        return (lambda w: w.T.reshape(d, heads, h), lambda w: w.reshape(d, heads * h).T, read)

    def proj_out(t, i):   # torch Linear [D, N*H] <-> ours [N, H, D]
        x = t[i[2], _rows(i[0], n, h)]                          # [D', N' * H]
        return x.T.reshape(-1, h, x.shape[0])[:, i[1], :]

    def bias(heads):
        return (lambda w: w.reshape(heads, h), lambda w: w.reshape(heads * h),
                lambda t, i: t[_rows(i[0], heads, h)].reshape(-1, h)[:, i[1]])

    yield ("embed_tokens",), "model.embed_tokens.weight", *ident
    for i in range(cfg.num_layers):
        p, hf = f"layers_{i}", f"model.layers.{i}"
        yield (p, "input_norm", "scale"), f"{hf}.input_layernorm.weight", *ident
        yield (p, "post_norm", "scale"), f"{hf}.post_attention_layernorm.weight", *ident
        yield (p, "q_proj"), f"{hf}.self_attn.q_proj.weight", *proj_in(n)
        yield (p, "k_proj"), f"{hf}.self_attn.k_proj.weight", *proj_in(k)
        yield (p, "v_proj"), f"{hf}.self_attn.v_proj.weight", *proj_in(k)
        yield ((p, "o_proj"), f"{hf}.self_attn.o_proj.weight",
               lambda w: w.T.reshape(n, h, d), lambda w: w.reshape(n * h, d).T, proj_out)
        if cfg.attention_bias:
            yield (p, "q_bias"), f"{hf}.self_attn.q_proj.bias", *bias(n)
            yield (p, "k_bias"), f"{hf}.self_attn.k_proj.bias", *bias(k)
            yield (p, "v_bias"), f"{hf}.self_attn.v_proj.bias", *bias(k)
        yield (p, "gate_proj"), f"{hf}.mlp.gate_proj.weight", *transpose
        yield (p, "up_proj"), f"{hf}.mlp.up_proj.weight", *transpose
        yield (p, "down_proj"), f"{hf}.mlp.down_proj.weight", *transpose
    yield ("norm", "scale"), "model.norm.weight", *ident
    if not cfg.tie_word_embeddings:
        yield ("lm_head",), "lm_head.weight", *transpose


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> file that holds it."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        with safe_open(single, "numpy") as f:
            return {name: single for name in f.keys()}
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
        for fn in sorted(set(files.values())):
            if not os.path.isfile(fn):
                raise FileNotFoundError(f"{index} names shard {os.path.basename(fn)}, "
                                        f"which is missing")
        return files
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_hf_params(path: str, cfg: ModelConfig, dtype: str = "float32",
                   shardings=None, expected_shapes=None, read_log: list | None = None):
    """Read a HF checkpoint dir into our params tree (numpy -> device arrays).

    `shardings`: optional tree (same structure) of `jax.sharding.Sharding` to place each
    weight straight onto; each weight is then read one addressable shard at a time, only
    that shard's part of the file (`jax.make_array_from_callback`): a process of a mesh
    spanning several reads only what it holds. `expected_shapes`: tree of shapes to
    check against (required with `shardings`: the shape comes before any read).
    `read_log`: gets (HF name, elements read) for every read.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    if shardings is not None and expected_shapes is None:
        raise ValueError("load_hf_params: shardings need expected_shapes")
    np_dtype = DTYPES[dtype]
    files = _weight_files(path)
    handles: dict[str, object] = {}
    params: dict = {}
    try:
        for ours, name, to_ours, _, read in _mapping(cfg):
            if name not in files:
                raise ValueError(f"checkpoint {path} is missing weight {name!r}")
            fn = files[name]
            if fn not in handles:
                handles[fn] = safe_open(fn, "numpy").__enter__()
            want = tree_get(expected_shapes, ours)
            sharding = tree_get(shardings, ours)
            if sharding is not None:
                arr = _read_sharded(handles[fn], name, tuple(want), sharding, read, np_dtype,
                                    read_log)
            else:
                w = to_ours(handles[fn].get_tensor(name).astype(np.float32)).astype(np_dtype)
                if read_log is not None:
                    read_log.append((name, w.size))
                if want is not None and tuple(w.shape) != tuple(want):
                    raise ValueError(f"weight {name!r} has shape {tuple(w.shape)} after "
                                     f"conversion, expected {tuple(want)} from config.json")
                arr = jnp.asarray(w)
            tree_set(params, ours, arr)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return params


def _read_sharded(handle, name: str, shape: tuple, sharding, read, np_dtype,
                  read_log: list | None) -> jax.Array:
    """Weight `name`, of our `shape`, onto `sharding`: each addressable shard read from
    the file on its own (replicated shards of one index read once)."""
    tensor = handle.get_slice(name)
    size = int(np.prod(tensor.get_shape()))
    if size != int(np.prod(shape)):
        raise ValueError(f"weight {name!r} has {size} elements, expected {int(np.prod(shape))} "
                         f"(shape {shape}) from config.json")
    done: dict = {}

    def shard(index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in done:
            part = np.asarray(read(tensor, index), np.float32).astype(np_dtype)
            want = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            if part.shape != want:
                raise ValueError(f"weight {name!r}: read a shard of shape {part.shape}, "
                                 f"expected {want} (shape {shape} from config.json)")
            if read_log is not None:
                read_log.append((name, part.size))
            done[key] = part
        return done[key]
    return jax.make_array_from_callback(shape, sharding, shard)


def save_hf_params(params, cfg: ModelConfig, path: str, dtype: str = "float32") -> None:
    """Write our params as `model.safetensors` with HF names (config.json is the caller's)."""
    np_dtype = DTYPES[dtype]
    tensors = {}
    for ours, name, _, to_hf, _ in _mapping(cfg):
        w = np.asarray(jax.device_get(tree_get(params, ours))).astype(np.float32)
        tensors[name] = np.ascontiguousarray(to_hf(w)).astype(np_dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def tree_get(tree, path):
    """The leaf of nested dicts `tree` at key path `path` (None for no tree)."""
    if tree is None:
        return None
    for key in path:
        tree = tree[key]
    return tree


def tree_set(tree: dict, path, value) -> None:
    """Set the leaf at key path `path` of nested dicts `tree`, making dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
