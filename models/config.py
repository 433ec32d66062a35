"""Model configuration, read from a Hugging Face `config.json`.

Supported families (`model_type`): llama (Llama 2/3, incl. `rope_scaling.rope_type ==
"llama3"`), mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), gemma3_text (local and
global layers, (1 + w) norms, GeGLU, scaled embeddings, final logit softcapping), gemma2
(the same without q/k norms, with attention softcapping), and the mixtures of experts
qwen3_moe, mixtral and qwen2_moe. Anything
that would make us silently compute something else than the reference is refused with a
`ValueError` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import os

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
                         "qwen3_moe", "mixtral", "qwen2_moe")
# `architectures[0]` of a config.json -> its model_type, to name what is supported.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Qwen3MoeForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int            # D
    intermediate_size: int      # F
    num_layers: int             # L
    num_heads: int              # N
    num_kv_heads: int           # K
    head_dim: int               # H
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False   # bias on q, k, v (qwen2)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3 and Gemma 3: RMSNorm over each q and k head before RoPE.
    qk_norm: bool = False
    # Gemma: norms scale by (1 + w); the MLP's gate is `hidden_act`; embeddings are
    # scaled by sqrt(D); each sub-layer's output is normed before its residual add
    # (`sandwich_norms`: post-attention, pre- and post-feedforward norms).
    norm_plus_one: bool = False
    hidden_act: str = "silu"
    embed_scale: bool = False
    sandwich_norms: bool = False
    # Scores are q.k * attn_scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar
    # ** -0.5), then `attn_softcap * tanh(scores / attn_softcap)` where set; logits
    # likewise with `final_softcap`.
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Local layers: True where layer i attends only to the last `sliding_window` keys
    # (its own included); they rotate with `rope_local_theta`, the global layers with
    # `rope_theta` (and `rope_linear_factor`: positions divided by it, global only).
    sliding_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    rope_linear_factor: float = 1.0
    # Mixture of experts: layer i is sparse where `sparse_layers[i]`: a router picks
    # `num_experts_per_tok` of `num_experts` SwiGLU experts (`moe_intermediate_size`
    # wide) and weighs them by its softmax, renormalised over the top k when
    # `norm_topk_prob`; `shared_expert_intermediate_size` > 0 adds a shared expert
    # gated by sigmoid(x . w) (Qwen2-MoE). Dense layers keep `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; "
                             f"expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; expected one "
                             f"of {ACTIVATIONS}")
        for name in ("sliding_layers", "sparse_layers"):
            value = getattr(self, name)
            if value and len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers")
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding layers need sliding_window > 0, got {self.sliding_window}")
        if any(self.sparse_layers):
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"1..num_experts={self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got "
                                 f"{self.moe_intermediate_size}")
        for name in ("attn_softcap", "final_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def num_params(self) -> int:
        """Every weight, every expert's included."""
        return self._params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """The weights one token reads: a sparse layer's router, its top-k experts and
        shared expert only (`num_params` for a dense model)."""
        return self._params(self.num_experts_per_tok)

    def _params(self, experts: int) -> int:
        d, v, h = self.hidden_size, self.vocab_size, self.head_dim
        attn = (d * h * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * h * self.qk_norm
                + h * (self.num_heads + 2 * self.num_kv_heads) * self.attention_bias)
        norms = (4 if self.sandwich_norms else 2) * d
        total = 0
        for i in range(self.num_layers):
            if self.is_sparse(i):
                mlp = (d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
                       + (3 * d * self.shared_expert_intermediate_size + d
                          if self.shared_expert_intermediate_size else 0))
            else:
                mlp = 3 * d * self.intermediate_size
            total += attn + mlp + norms
        return total + v * d * (1 if self.tie_word_embeddings else 2) + d

    def logical_dims(self) -> dict[str, int]:
        """The sizes `jaxpd.sharding.logical_rules` needs to decide what splits over tp
        (sharding knows no model): `logical_rules(mesh, **cfg.logical_dims())`."""
        dims = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}
        if self.is_moe:
            dims.update(num_experts=self.num_experts,
                        moe_intermediate_size=self.moe_intermediate_size,
                        shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        return dims

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from the dict of a Hugging Face `config.json`, refusing what we can't run."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = (cfg.get("architectures") or [None])[0]
            raise ValueError(f"config.json: model_type={model_type!r} (architecture {arch!r}) "
                             f"is not supported; supported model types: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (architectures "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if name not in cfg:
                raise ValueError(f"config.json: missing required field {name!r}")
        gemma = model_type in ("gemma2", "gemma3_text")
        hidden_act = cfg.get("hidden_activation" if gemma else "hidden_act",
                             "gelu_pytorch_tanh" if gemma else "silu")
        acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
        if hidden_act not in acts:
            raise ValueError(f"config.json: hidden_act={hidden_act!r} is not supported "
                             f"(supported: {', '.join(acts)})")
        if cfg.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        num_layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=acts[hidden_act],
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        )
        if gemma:
            fields.update(_gemma_fields(cfg, model_type, num_layers))
        else:
            _refuse_sliding_window(cfg, model_type, num_layers, max_pos)
        if model_type in MOE_MODEL_TYPES:
            fields.update(_moe_fields(cfg, model_type, num_layers))
        return cls(**fields)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f))


def _refuse_sliding_window(cfg: dict, model_type: str, num_layers: int, max_pos: int) -> None:
    """Outside Gemma, a sliding window narrower than the context is refused: those
    families mark windowed layers differently (`max_window_layers`), and no checkpoint
    we serve uses one."""
    window = cfg.get("sliding_window")
    use_window = cfg.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and use_window:
        max_window_layers = cfg.get("max_window_layers", num_layers)
        use_window = max_window_layers < num_layers
    if use_window and window and window < max_pos:
        raise ValueError(f"config.json: sliding_window={window} < max_position_embeddings="
                         f"{max_pos} is not supported for model_type={model_type!r} "
                         f"(sliding-window attention is served for gemma3_text)")


def _gemma_fields(cfg: dict, model_type: str, num_layers: int) -> dict:
    """Gemma's local/global layers and its norms, scale and softcaps. Gemma 3's
    attention ignores `attn_logit_softcapping` (transformers' does), Gemma 2's applies
    it; Gemma 2 alternates local and global layers, Gemma 3 has one global in 6."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:      # configs older than `layer_types`
        pattern = (2 if model_type == "gemma2" else cfg.get("sliding_window_pattern")
                   or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported "
                         f"(supported: full_attention, sliding_attention)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:    # per layer type
        local = params.get("sliding_attention") or {}
        glob = params.get("full_attention") or {}
    else:                        # one rope for every layer (Gemma 2)
        local = glob = dict(params)
        if cfg.get("rope_theta"):
            local = glob = {**params, "rope_theta": cfg["rope_theta"]}
    factor = 1.0
    scaling = cfg.get("rope_scaling") or glob
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "linear":
        factor = float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"config.json: rope type {kind!r} of the global layers is not "
                         f"supported (supported: default, linear)")
    local_kind = local.get("rope_type", "default")
    if local_kind != "default":
        raise ValueError(f"config.json: rope type {local_kind!r} of the local layers is not "
                         f"supported (supported: default)")
    window = cfg.get("sliding_window")
    return dict(
        norm_plus_one=True, embed_scale=True, sandwich_norms=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim")
                         or cfg["hidden_size"] // cfg["num_attention_heads"]) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        final_softcap=cfg.get("final_logit_softcapping"),
        sliding_layers=sliding if any(sliding) else (),
        sliding_window=int(window) if any(sliding) and window else None,
        rope_theta=float(glob.get("rope_theta") or cfg.get("rope_theta") or 1e6),
        rope_local_theta=float(cfg.get("rope_local_base_freq") or local.get("rope_theta")
                               or 10000.0),
        rope_linear_factor=factor, rope_scaling=None,
    )


def _moe_fields(cfg: dict, model_type: str, num_layers: int) -> dict:
    """Routing and expert sizes of the mixtures of experts."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ValueError(f"config.json: model_type={model_type!r} needs num_experts (or "
                         f"num_local_experts) and num_experts_per_tok")
    if model_type == "mixtral":
        sparse = (True,) * num_layers
        width = cfg["intermediate_size"]
        norm = True
    else:
        step = cfg.get("decoder_sparse_step", 1) or 1
        only_mlp = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(num_layers))
        if "moe_intermediate_size" not in cfg:
            raise ValueError("config.json: missing required field 'moe_intermediate_size'")
        width = cfg["moe_intermediate_size"]
        norm = bool(cfg.get("norm_topk_prob", False))
    shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(width), norm_topk_prob=norm,
                shared_expert_intermediate_size=int(shared or 0),
                sparse_layers=sparse if any(sparse) else ())


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_scaling`.
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs or cfg.get("model_type") in ("gemma2", "gemma3_text"):   # `_gemma_fields`
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"config.json: rope_scaling type {kind!r} is not supported "
                         f"(supported: default, llama3)")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json: rope_scaling is missing field {e.args[0]!r}") from None
