"""GGUF checkpoints (llama.cpp's single-file format) -> `ModelConfig`, weights, `Tokenizer`.

Read with the `gguf` package, which also dequantizes every tensor type it knows (F32,
F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants, the IQ types); we only map names and
layouts. Plain numpy: no jax here, so the router reads config and tokenizer from a GGUF
file without loading jax.

Architectures: llama (and mistral), qwen2, qwen3, gemma2, gemma3 (text), qwen2moe,
qwen3moe, and Mixtral, which llama.cpp files as llama with `llama.expert_count` > 0.

llama.cpp's converter changes some things we undo, and its loader derives some
hyperparameters instead of storing them; we derive them as it does:
- for llama (and mistral, and Mixtral) it permutes the rows of each head of
  `attn_q`/`attn_k` so that rope pairs are adjacent (GPT-J style); we put them back in
  halves (the Hugging Face rotate-half layout our rope uses).
- Gemma's norms are stored as 1 + w (llama.cpp multiplies by the stored weight); we
  subtract the 1 again (exact in float32 for the weights Gemma has).
- Gemma's local layers: gemma2 alternates local and global from layer 0 (window
  `attention.sliding_window`, 4096 when absent); gemma3 has every sixth layer global
  (`attention.sliding_window_pattern`, a period or per-layer flags, where present),
  and no local layers without a window. gemma3's local layers rotate with
  `rope.freq_base_swa` (10000 when absent), unscaled; `rope.scaling` linear applies to
  its global layers only. Attention scores are scaled by head_dim ** -0.5, or
  (hidden / heads) ** -0.5 for the 27B models (46 layers for gemma2, 62 for gemma3):
  the file does not store `query_pre_attn_scalar`. gemma2 softcaps attention scores
  and logits (50 and 30 when absent); gemma3 softcaps logits only where the file says.
- Mixtures of experts: every layer is sparse (llama.cpp builds no dense layer in these
  architectures, and its converter cannot write one); experts are stacked 3-D tensors
  `ffn_{gate,up,down}_exps`. Top-k weights are renormalised for Mixtral and qwen3moe
  and not for qwen2moe, whose shared expert is gated by sigmoid(`ffn_gate_inp_shexp`).
  Stacked experts in a kept block format stay quantized with quantization="auto"
  (`models.moe`), as projections do; routers and shared experts are served as float, a
  quantized one dequantized at load.
- Q4_K and Q6_K (`models.kquant`) are kept like the other block formats, re-read at load.
- the tokenizer is metadata instead of a `tokenizer.json`; `gguf_tokenizer` rebuilds it.

Anything we would run differently from llama.cpp is refused with a `ValueError` naming
the metadata key or tensor and its value.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterator

import gguf
import numpy as np

from jaxpd.models.config import ModelConfig
from jaxpd.models.gguf_tokenizer import tokenizer
from jaxpd.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                           "qwen2moe", "qwen3moe")
# `general.architecture` -> our `ModelConfig.model_type` where the names differ (llama
# with experts is Mixtral: `_model_type`).
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Architectures with an RMSNorm over each q and k head (`attn_q_norm`, `attn_k_norm`).
_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
# Model types whose q/k rows llama.cpp's converter permutes (its `LlamaModel`).
_PERMUTED_QK = ("llama", "mistral", "mixtral")
_GEMMA = ("gemma2", "gemma3")
# Mixtures of experts: whether llama.cpp renormalises the top-k weights (fixed per
# architecture in its graphs), and whether a shared expert runs beside the routed ones.
_MOE = {"llama": dict(norm=True, shared=False), "qwen3moe": dict(norm=True, shared=False),
        "qwen2moe": dict(norm=False, shared=True)}
# llama.cpp's expert gating function id for a softmax over the router's logits.
_SOFTMAX_GATING = 1
_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFFile:
    """A GGUF file's metadata (parsed on demand) and tensors (memory-mapped)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        self.path = path
        try:
            self._reader = gguf.GGUFReader(path)
        except ValueError as e:   # a tensor's bytes run past the end of the file
            raise ValueError(f"{path}: cannot be read as GGUF ({e}): the file is corrupt "
                             f"or truncated") from None
        self.tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else _field_value(field)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: missing metadata key {key!r}")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's numpy shape (GGUF lists dimensions innermost first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))


def _field_value(field):
    """A metadata value as Python: str, int, float, bool, or a list of them (the parts
    API is the same since gguf 0.10; `ReaderField.contents` is newer)."""
    string = gguf.GGUFValueType.STRING
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if not field.data:
            return []
        if field.types[-1] == string:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8") if field.types[0] == string else part.tolist()[0]


def model_config(f: GGUFFile) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes, refusing what we can't run."""
    arch = f.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{f.path}: general.architecture={arch!r} is not supported; "
                         f"expected one of {SUPPORTED_ARCHITECTURES} (Mixtral: llama with "
                         f"llama.expert_count > 0)")

    def key(name: str, default=None):
        value = f.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{f.path}: missing metadata key {arch}.{name!r}")
        if isinstance(value, list):
            raise ValueError(f"{f.path}: {arch}.{name} varies per layer ({value[:4]}...), "
                             f"which is not supported")
        return value

    num_experts = key("expert_count", 0)
    if num_experts and arch not in _MOE:
        raise ValueError(f"{f.path}: {arch}.expert_count={num_experts} (mixture of experts) "
                         f"is not supported for {arch}; experts are served for "
                         f"{tuple(_MOE)}")
    if arch in ("qwen2moe", "qwen3moe") and not num_experts:
        raise ValueError(f"{f.path}: missing metadata key {arch}.expert_count "
                         f"(a {arch} file has experts)")
    model_type = "mixtral" if arch == "llama" and num_experts else _MODEL_TYPES.get(arch, arch)
    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    num_layers = key("block_count")
    head_dim = key("attention.key_length", hidden // num_heads)
    for name, value in (("attention.value_length", key("attention.value_length", head_dim)),
                        ("rope.dimension_count", key("rope.dimension_count", head_dim))):
        if value != head_dim:
            raise ValueError(f"{f.path}: {arch}.{name}={value} differs from the head size "
                             f"{head_dim}, which is not supported")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none" and not (arch == "gemma3" and scaling == "linear"):
        raise ValueError(f"{f.path}: {arch}.rope.scaling.type={scaling!r} is not supported "
                         f"(supported: none; linear for gemma3's global layers)")
    if "rope_freqs.weight" in f.tensors:
        # Llama 3.1+ scaling, stored as per-frequency factors rather than its parameters.
        raise ValueError(f"{f.path}: tensor 'rope_freqs.weight' (rope frequency factors) "
                         f"is not supported")
    context = key("context_length")
    if arch not in _GEMMA:
        window = key("attention.sliding_window", 0)
        if 0 < window < context:
            raise ValueError(f"{f.path}: {arch}.attention.sliding_window={window} < "
                             f"context_length={context} is not supported for {arch} "
                             f"(sliding windows are served for gemma2 and gemma3)")
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"{f.path}: missing tensor 'token_embd.weight'")
    tokens = f.get("tokenizer.ggml.tokens") or []
    vocab_size = key("vocab_size", len(tokens) or f.shape("token_embd.weight")[0])
    eos = [f.get(f"tokenizer.ggml.{name}") for name in ("eos_token_id", "eot_token_id")]
    fields = dict(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        # Optional in a mixture of experts (no dense MLP): `_moe_fields` fills it in.
        intermediate_size=key("feed_forward_length", 0 if num_experts else None),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        tie_word_embeddings="output.weight" not in f.tensors,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        qk_norm=arch in _QK_NORM,
    )
    if arch in _GEMMA:
        fields.update(_gemma_fields(f, arch, key, fields))
    if num_experts:
        fields.update(_moe_fields(f, arch, key, num_experts, fields))
    return ModelConfig(**fields)


def _swa_layers(period: int, num_layers: int) -> tuple[bool, ...]:
    """llama.cpp's `set_swa_pattern`: every `period`-th layer global (the last of each
    period), the rest local; period 0: all local."""
    return tuple(period == 0 or i % period < period - 1 for i in range(num_layers))


def _gemma_fields(f: GGUFFile, arch: str, key, fields: dict) -> dict:
    """Gemma's local/global layers, rope bases, attention scale and softcaps, derived
    from the metadata as llama.cpp's loader derives them (module docstring)."""
    num_layers, hidden, num_heads = (fields["num_layers"], fields["hidden_size"],
                                     fields["num_heads"])
    name = f"{arch}.attention.sliding_window_pattern"
    pattern = f.get(name)
    if arch == "gemma2":
        window = key("attention.sliding_window", 4096)
        sliding = _swa_layers(2, num_layers)
        if pattern is not None and _pattern_layers(f, name, pattern, num_layers) != sliding:
            raise ValueError(f"{f.path}: {name}={pattern!r} differs from gemma2's "
                             f"alternating local/global layers, which llama.cpp runs")
        local_theta = fields["rope_theta"]
        attn_softcap = float(key("attn_logit_softcapping", 50.0))
        final_softcap = float(key("final_logit_softcapping", 30.0))
        big = num_layers == 46
    else:
        window = key("attention.sliding_window", 0)
        sliding = (_swa_layers(6, num_layers) if pattern is None
                   else _pattern_layers(f, name, pattern, num_layers)) if window else ()
        local_theta = float(key("rope.freq_base_swa", 10000.0))
        attn_softcap = None
        final = f.get(f"{arch}.final_logit_softcapping")
        final_softcap = float(final) if final else None
        big = num_layers == 62
    factor = 1.0
    if key("rope.scaling.type", "none") == "linear":
        factor = float(key("rope.scaling.factor"))
        if factor <= 0:
            raise ValueError(f"{f.path}: {arch}.rope.scaling.factor={factor} must be positive")
    # llama.cpp: (hidden / heads) ** -0.5 for the 27B models, head_dim ** -0.5 otherwise.
    scale_dim = hidden // num_heads if big else fields["head_dim"]
    return dict(
        hidden_act="gelu_tanh", norm_plus_one=True, embed_scale=True, sandwich_norms=True,
        attn_scale=float(scale_dim) ** -0.5, attn_softcap=attn_softcap,
        final_softcap=final_softcap,
        sliding_layers=sliding if any(sliding) else (),
        sliding_window=int(window) if any(sliding) else None,
        rope_local_theta=local_theta, rope_linear_factor=factor,
    )


def _pattern_layers(f: GGUFFile, name: str, pattern, num_layers: int) -> tuple[bool, ...]:
    """`attention.sliding_window_pattern`: a period (`_swa_layers`) or one flag per layer
    (true: local)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{f.path}: {name} has {len(pattern)} entries for "
                             f"{num_layers} layers")
        return tuple(bool(p) for p in pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ValueError(f"{f.path}: {name}={pattern!r} is neither a layer period nor a "
                         f"per-layer list")
    return _swa_layers(pattern, num_layers)


def _moe_fields(f: GGUFFile, arch: str, key, num_experts: int, fields: dict) -> dict:
    """Routing and expert sizes; every layer sparse, as llama.cpp builds these models."""
    rules, num_layers, ffn = _MOE[arch], fields["num_layers"], fields["intermediate_size"]
    for i in range(num_layers):
        router = f"blk.{i}.ffn_gate_inp.weight"
        if router not in f.tensors:
            dense = f"blk.{i}.ffn_gate.weight" in f.tensors
            raise ValueError(
                f"{f.path}: missing tensor {router!r}"
                + (f" (layer {i} is a dense MLP: a {arch} file with experts has them in "
                   f"every layer, as llama.cpp runs it; layers without experts -- "
                   f"mlp_only_layers, decoder_sparse_step -- are not supported)"
                   if dense else ""))
    norm = key("expert_weights_norm", rules["norm"])
    if bool(norm) != rules["norm"]:
        raise ValueError(f"{f.path}: {arch}.expert_weights_norm={norm} differs from what "
                         f"llama.cpp runs for {arch} (renormalised top-k: {rules['norm']})")
    gating = key("expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise ValueError(f"{f.path}: {arch}.expert_gating_func={gating} is not supported "
                         f"(supported: {_SOFTMAX_GATING}, softmax)")
    scale = key("expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):
        raise ValueError(f"{f.path}: {arch}.expert_weights_scale={scale} is not supported "
                         f"(supported: 1.0)")
    shared_count = key("expert_shared_count", 1 if rules["shared"] else 0)
    if shared_count != (1 if rules["shared"] else 0):
        raise ValueError(f"{f.path}: {arch}.expert_shared_count={shared_count} is not "
                         f"supported for {arch} (supported: {int(rules['shared'])})")
    gate_exps = "blk.0.ffn_gate_exps.weight"
    if gate_exps not in f.tensors:
        raise ValueError(f"{f.path}: missing tensor {gate_exps!r} (per-expert tensors "
                         f"`blk.N.ffn_gate.E.weight` of old Mixtral files are not supported)")
    if arch == "llama":
        width = key("feed_forward_length")
    else:
        width = key("expert_feed_forward_length", f.shape(gate_exps)[1])
    shared = 0
    if rules["shared"]:
        # llama.cpp: the shared expert is `feed_forward_length` wide unless stated.
        shared = key("expert_shared_feed_forward_length", ffn or None)
    return dict(intermediate_size=int(ffn or width),
                num_experts=int(num_experts), num_experts_per_tok=int(key("expert_used_count")),
                moe_intermediate_size=int(width), norm_topk_prob=rules["norm"],
                shared_expert_intermediate_size=int(shared),
                sparse_layers=(True,) * num_layers)


def _mapping(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], str, Callable, Callable | None]]:
    """(our path, GGUF tensor name, numpy [rows, cols] -> ours, and for a weight that
    may stay quantized: (its [rows, ...] parts -> output channels in our order, the
    sizes of its contraction dims)) for every
    weight; the GGUF layout is torch's Linear [out, in], as in `hf_io`."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    permuted = cfg.model_type in _PERMUTED_QK

    def unpermute(w, heads):
        # llama.cpp: rows of a head reordered [2, H/2] -> [H/2, 2]; put them back.
        if not permuted:
            return w
        return w.reshape(heads, h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def proj_in(heads, rope: bool):   # [heads*H, D] -> [D, heads, H]
        return lambda w: (unpermute(w, heads) if rope else w).T.reshape(d, heads, h)

    def rows_in(heads, rope: bool):   # [heads*H, X] -> [heads, H, X]
        return lambda w: (unpermute(w, heads) if rope else w).reshape(heads, h, -1)

    def bias(heads, rope: bool):
        return lambda w: (unpermute(w, heads) if rope else w).reshape(heads, h)

    def ident(w):
        return w

    def transpose(w):
        return w.T

    # Gemma's norms are stored as 1 + w (llama.cpp's converter adds the 1).
    norm = (lambda w: w - np.float32(1.0)) if cfg.norm_plus_one else ident

    def swap(w):   # stacked experts [E, out, in] -> ours [E, in, out]
        return w.swapaxes(1, 2)

    f_moe = cfg.moe_intermediate_size

    yield ("embed_tokens",), "token_embd.weight", ident, (ident, (d,))
    for i in range(cfg.num_layers):
        p, b = f"layers_{i}", f"blk.{i}"
        yield (p, "input_norm", "scale"), f"{b}.attn_norm.weight", norm, None
        if cfg.sandwich_norms:
            yield (p, "post_norm", "scale"), f"{b}.post_attention_norm.weight", norm, None
            yield (p, "pre_ff_norm", "scale"), f"{b}.ffn_norm.weight", norm, None
            yield (p, "post_ff_norm", "scale"), f"{b}.post_ffw_norm.weight", norm, None
        else:
            yield (p, "post_norm", "scale"), f"{b}.ffn_norm.weight", norm, None
        yield (p, "q_proj"), f"{b}.attn_q.weight", proj_in(n, rope=True), (rows_in(n, rope=True), (d,))
        yield (p, "k_proj"), f"{b}.attn_k.weight", proj_in(k, rope=True), (rows_in(k, rope=True), (d,))
        yield (p, "v_proj"), f"{b}.attn_v.weight", proj_in(k, rope=False), (rows_in(k, rope=False), (d,))
        yield (p, "o_proj"), f"{b}.attn_output.weight", lambda w: w.T.reshape(n, h, d), (ident, (n, h))
        if cfg.attention_bias:
            yield (p, "q_bias"), f"{b}.attn_q.bias", bias(n, rope=True), None
            yield (p, "k_bias"), f"{b}.attn_k.bias", bias(k, rope=True), None
            yield (p, "v_bias"), f"{b}.attn_v.bias", bias(k, rope=False), None
        if cfg.qk_norm:
            yield (p, "q_norm", "scale"), f"{b}.attn_q_norm.weight", norm, None
            yield (p, "k_norm", "scale"), f"{b}.attn_k_norm.weight", norm, None
        if cfg.is_sparse(i):
            # Router [E, D] -> [D, E], served as float; experts [E, F', D] / [E, D, F']
            # -> [E, D, F'] / [E, F', D], or kept as stored: [E, F', D'] / [E, D, F''],
            # experts and output channels first (`moe.EXPERT_IN_DIMS`).
            yield (p, "router"), f"{b}.ffn_gate_inp.weight", transpose, None
            yield (p, "experts_gate"), f"{b}.ffn_gate_exps.weight", swap, (ident, (d,))
            yield (p, "experts_up"), f"{b}.ffn_up_exps.weight", swap, (ident, (d,))
            yield ((p, "experts_down"), f"{b}.ffn_down_exps.weight", swap,
                   (ident, (f_moe,)))
            if cfg.shared_expert_intermediate_size:
                yield (p, "shared_gate_proj"), f"{b}.ffn_gate_shexp.weight", transpose, None
                yield (p, "shared_up_proj"), f"{b}.ffn_up_shexp.weight", transpose, None
                yield (p, "shared_down_proj"), f"{b}.ffn_down_shexp.weight", transpose, None
                # [D] (the converter squeezes [1, D]) -> [D, 1]
                yield ((p, "shared_expert_gate"), f"{b}.ffn_gate_inp_shexp.weight",
                       lambda w: w.reshape(-1, 1), None)
            continue
        yield (p, "gate_proj"), f"{b}.ffn_gate.weight", transpose, (ident, (d,))
        yield (p, "up_proj"), f"{b}.ffn_up.weight", transpose, (ident, (d,))
        yield (p, "down_proj"), f"{b}.ffn_down.weight", transpose, (ident, (cfg.intermediate_size,))
    yield ("norm", "scale"), "output_norm.weight", norm, None
    if not cfg.tie_word_embeddings:
        yield ("lm_head",), "output.weight", transpose, (ident, (d,))


def weights(f: GGUFFile, cfg: ModelConfig, keep_quantized: bool = False
            ) -> Iterator[tuple[tuple[str, ...], object]]:
    """(our param path, weight in our layout) for every weight, one tensor at a time so
    peak host memory stays near one float32 tensor: float32 arrays, or with
    `keep_quantized` a `models.quant.QuantizedWeight` of numpy parts for every
    projection stored in a kept block format (`quant.GGUF_FORMATS`, `kquant.K_FORMATS`);
    a projection in another quantized type is refused, naming it (quantization="none"
    reads it as float)."""
    mapping = list(_mapping(cfg))
    unexpected = sorted(set(f.tensors) - {name for _, name, _, _ in mapping})
    if unexpected:
        raise ValueError(f"{f.path}: tensors {unexpected[:5]} are not part of a "
                         f"{cfg.model_type} model we can run")
    for ours, name, to_ours, rows in mapping:
        if name not in f.tensors:
            raise ValueError(f"{f.path}: missing tensor {name!r}")
        qtype = f.tensors[name].tensor_type.name
        if keep_quantized and rows is not None and qtype not in _FLOAT_TYPES:
            yield ours, _kept(f, name, ours[-1], rows)
        else:
            yield ours, to_ours(dequantize(f, name))


def tensor_names(cfg: ModelConfig) -> dict[tuple[str, ...], str]:
    """Our param path -> the GGUF tensor it is read from."""
    return {ours: name for ours, name, _, _ in _mapping(cfg)}


def unkept_tensor(f: GGUFFile, cfg: ModelConfig) -> tuple[str, str] | None:
    """(name, quant type) of the first projection `weights(keep_quantized=True)` would
    refuse (a quantized type not served kept), or None when every one can be kept."""
    from jaxpd.models import kquant, quant

    for _, name, _, rows in _mapping(cfg):
        if rows is None or name not in f.tensors:
            continue
        qtype = f.tensors[name].tensor_type.name
        if qtype not in _FLOAT_TYPES + tuple(quant.GGUF_FORMATS) + tuple(kquant.K_FORMATS):
            return name, qtype
    return None


def float_served_quantized(f: GGUFFile, cfg: ModelConfig) -> list[tuple[str, str]]:
    """(name, quant type) of every quantized tensor that is served as float whatever
    the quantization, dequantized at load: the routers and shared experts of a mixture
    of experts (its stacked experts are kept like the projections)."""
    out = []
    for _, name, _, rows in _mapping(cfg):
        if name in f.tensors:
            qtype = f.tensors[name].tensor_type.name
            if qtype not in _FLOAT_TYPES and rows is None:
                out.append((name, qtype))
    return out


def _kept(f: GGUFFile, name: str, ours: str, rows: Callable):
    from jaxpd.models import kquant, quant
    from jaxpd.models.layout import QUANTIZABLE
    from jaxpd.models.moe import EXPERT_IN_DIMS

    tensor = f.tensors[name]
    qtype = tensor.tensor_type.name
    fmt = quant.GGUF_FORMATS.get(qtype)
    if fmt is None and qtype not in kquant.K_FORMATS:
        raise ValueError(f"{f.path}: tensor {name!r} has quant type {qtype}, which is not "
                         f"served kept quantized (kept: "
                         f"{sorted(quant.GGUF_FORMATS) + sorted(kquant.K_FORMATS)}); pass "
                         f"quantization='none' to dequantize it to float at load")
    *lead, cols = f.shape(name)     # stacked experts: [E, out, cols]
    rows_fn, in_shape = rows
    if math.prod(in_shape) != cols:
        raise ValueError(f"{f.path}: tensor {name!r} has rows of {cols} elements, "
                         f"expected {math.prod(in_shape)} from the metadata")
    if fmt is None:
        fmt, data, scale, low = kquant.from_gguf_k_rows(tensor.data, qtype, math.prod(lead),
                                                        cols, name)
    else:
        data, scale, low = quant.from_gguf_rows(tensor.data, qtype.lower(), math.prod(lead),
                                                cols, name)
    in_dims = EXPERT_IN_DIMS[ours] if ours in EXPERT_IN_DIMS else QUANTIZABLE[ours]
    parts = [None if a is None else rows_fn(a.reshape(*lead, a.shape[-1]))
             for a in (data, scale, low)]
    out_shape = iter(parts[0].shape[:-1])
    in_sizes = iter(in_shape)
    float_shape = tuple(next(in_sizes) if i in in_dims else next(out_shape)
                        for i in range(len(in_dims) + parts[0].ndim - 1))
    return quant.QuantizedWeight(*parts, fmt=fmt, float_shape=tuple(float_shape),
                                 in_dims=in_dims)


def dequantize(f: GGUFFile, name: str) -> np.ndarray:
    """One tensor as float32 in numpy layout, through `gguf`'s own dequantizers."""
    tensor = f.tensors[name]
    qtype = tensor.tensor_type
    if qtype.name.startswith("I") and not qtype.name.startswith("IQ"):   # I8 ... I64
        raise ValueError(f"{f.path}: tensor {name!r} has integer type {qtype.name}, "
                         f"which is not a weight type")
    try:
        w = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ValueError(f"{f.path}: tensor {name!r} has quant type {qtype.name}, which "
                         f"gguf {_gguf_version()} cannot dequantize") from None
    return np.asarray(w, np.float32).reshape(f.shape(name))


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def read_config_and_tokenizer(path: str) -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer of a GGUF file, without reading any tensor data."""
    f = GGUFFile(path)
    return model_config(f), tokenizer(f)
