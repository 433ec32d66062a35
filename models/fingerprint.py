"""A model's fingerprint: one digest of everything that makes two processes' KV caches
interchangeable (plain Python, no jax: the router imports it).

KV computed by one set of weights is meaningless to another even when every shape
matches, so shapes, dtypes and checksums cannot tell two models apart; the fingerprint
can. It covers:

- the weights: blake2b of every weight file's bytes (`*.safetensors`, an orbax
  `params/` tree, a GGUF file), cached in `$JAXPD_CACHE/fingerprint` keyed by the
  checkpoint's absolute path and each file's size and mtime, so a checkpoint is read
  once per host and a changed file is read again;
- the tokenizer files (`tokenizer.json`, `tokenizer_config.json`, ...);
- the config fields that shape attention (layers, heads, kv heads, head dim, RoPE
  theta and scaling, q/k/v bias; a sliding window is refused by `ModelConfig`);
- the dtype the KV is stored in, the dtype it travels in (`kv_transfer_dtype`), and
  the page size;
- how the weights are held (kept quantized) and multiplied (int8 activations).

`short(fp)` (the first 12 hex digits) is what logs, /health and Info show.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from jaxpd import paths

SHORT = 12
_CHUNK = 8 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "chat_template.jinja")
_ATTENTION_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                     "attention_bias")
# Fields of the later families that change what K and V hold or which keys a layer
# reads; named only when set, so a model without them keeps the fingerprint it had.
_FAMILY_FIELDS = ("qk_norm", "attn_scale", "attn_softcap", "sliding_layers",
                  "sliding_window", "rope_local_theta", "rope_linear_factor", "num_experts",
                  "num_experts_per_tok", "sparse_layers")


def short(fingerprint: str) -> str:
    """The form people read: the first 12 hex digits."""
    return fingerprint[:SHORT]


def is_fingerprint(value) -> bool:
    """A peer's fingerprint field: 64 lower-case hex digits."""
    return (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value))


def model_fingerprint(path: str, cfg, kv_dtype: str, page_size: int,
                      kv_transfer_dtype: str | None = None, cache_dir: str | None = None,
                      quantization: str = "none", activations: str = "float") -> str:
    """The 64-hex-digit blake2b fingerprint of the checkpoint at `path` (a directory or
    a GGUF file) served as `cfg` (a `ModelConfig`) with KV stored in `kv_dtype`, sent
    in `kv_transfer_dtype` (None: as stored) in pages of `page_size` tokens, its
    weights held as `quantization` says (`checkpoint.LoadedModel.quantization`: other
    numbers, other KV) and multiplied with activations rounded to `activations` (int8:
    other numbers again; only quantized weights have such a product). Equal on
    every host that holds the same files and serves them alike; different when any
    weight byte differs. Raises OSError when the files cannot be read."""
    attention = {name: _plain(getattr(cfg, name, None)) for name in _ATTENTION_FIELDS}
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)} \
        if dataclasses.is_dataclass(cfg) else {}
    attention.update({name: _plain(getattr(cfg, name)) for name in _FAMILY_FIELDS
                      if hasattr(cfg, name) and getattr(cfg, name) != defaults.get(name)})
    parts = {"weights": weights_digest(path, cache_dir), "tokenizer": tokenizer_digest(path),
             "attention": attention, "kv_dtype": str(kv_dtype),
             "kv_transfer_dtype": kv_transfer_dtype or "", "page_size": int(page_size)}
    if quantization != "none":       # float weights keep the fingerprint they had
        parts["quantization"] = quantization
        if activations != "float":
            parts["activations"] = activations
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(),
                           digest_size=32).hexdigest()


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def weight_files(path: str) -> list[tuple[str, str]]:
    """(name relative to `path`, absolute path) of every weight file, sorted."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        rel_root = os.path.relpath(root, path)
        for name in sorted(files):
            rel = os.path.normpath(os.path.join(rel_root, name))
            if name.endswith(".safetensors") or rel.split(os.sep)[0] == "params":
                found.append((rel, os.path.join(root, name)))
    return found


def weights_digest(path: str, cache_dir: str | None = None) -> str:
    """blake2b over the weight files' names and bytes; read once per (path, size,
    mtime) of every file and then answered from the cache (a cache that cannot be
    read or written is recomputed, never trusted blindly: its key is the stat)."""
    path = os.path.abspath(path)
    files = weight_files(path)
    stat = [(rel, os.stat(full).st_size, os.stat(full).st_mtime_ns) for rel, full in files]
    key = hashlib.blake2b(json.dumps([path, stat]).encode(), digest_size=16).hexdigest()
    cache = os.path.join(cache_dir or paths.fingerprint_dir(), f"{key}.json")
    try:
        with open(cache) as f:
            cached = json.load(f)
        if cached.get("stat") == [list(s) for s in stat] and is_fingerprint(cached.get("digest")):
            return cached["digest"]
    except (OSError, ValueError):
        pass
    h = hashlib.blake2b(digest_size=32)
    for rel, full in files:
        h.update(f"\0{rel}\0".encode())
        with open(full, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"path": path, "stat": stat, "digest": digest}, f)
        os.replace(tmp, cache)
    except OSError:
        pass                        # a read-only home: recomputed next start
    return digest


def tokenizer_digest(path: str) -> str:
    """blake2b of the tokenizer files beside the weights (a GGUF file carries its
    tokenizer inside: its weights digest covers it)."""
    h = hashlib.blake2b(digest_size=32)
    if os.path.isdir(path):
        for name in TOKENIZER_FILES:
            full = os.path.join(path, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    h.update(f"\0{name}\0".encode() + f.read())
    return h.hexdigest()

