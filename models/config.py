"""Model configuration, read from a Hugging Face `config.json`.

Supported: `model_type` llama (Llama 2/3, incl. `rope_scaling.rope_type == "llama3"`),
mistral, qwen2 (q/k/v bias). Anything that would make us silently compute something
else than the reference is refused with a `ValueError` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import os

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * d * f + 2 * d
        return self.num_layers * layer + v * d * (1 if self.tie_word_embeddings else 2) + d

    def logical_dims(self) -> dict[str, int]:
        """The sizes `jaxpd.sharding.logical_rules` needs to decide what splits over tp
        (sharding knows no model): `logical_rules(mesh, **cfg.logical_dims())`."""
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from the dict of a Hugging Face `config.json`, refusing what we can't run."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={model_type!r} is not supported; "
                             f"expected one of {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads"):
            if name not in cfg:
                raise ValueError(f"config.json: missing required field {name!r}")
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act={hidden_act!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        num_layers = cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        # A sliding window that is actually narrower than the context changes attention;
        # we do not implement it, so refuse rather than run wrong.
        window = cfg.get("sliding_window")
        use_window = cfg.get("use_sliding_window", model_type == "mistral")
        if model_type == "qwen2" and use_window:
            max_window_layers = cfg.get("max_window_layers", num_layers)
            use_window = max_window_layers < num_layers
        if use_window and window is not None and window < max_pos:
            raise ValueError(f"config.json: sliding_window={window} < max_position_embeddings="
                             f"{max_pos} is not supported (sliding-window attention)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
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
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f))


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> RopeScaling | None:
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_scaling`.
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
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
