"""Where a model comes from: a Hugging Face checkpoint directory or a GGUF file.

Plain Python (no jax): the router and request validation read a model's config and
tokenizer from here without loading jax; `checkpoint.load` adds the weights.
"""
from __future__ import annotations

import glob
import os

from jaxpd.models.config import ModelConfig
from jaxpd.models.tokenizer import Tokenizer


# How weights are held: "none" (float), "int8" (weight-only, one scale per output
# channel, made at load from float weights), "auto" (a GGUF file's supported block
# formats kept as stored, `models.quant`; anything else "none").
QUANTIZATIONS = ("none", "int8", "auto")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def checkpoint_path(path: str) -> str:
    """`path` itself, or the one `.gguf` file of a directory that has no config.json (a
    GGUF repository downloaded from a hub)."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(os.path.basename(p) for p in found)
            raise ValueError(f"{path} holds several GGUF files ({names}); pass the path of one")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    return path


def model_config_and_tokenizer(path: str) -> tuple[ModelConfig, Tokenizer | None]:
    """The config and tokenizer of a checkpoint directory or GGUF file, reading no
    weights; the tokenizer is None for a directory without tokenizer.json."""
    path = checkpoint_path(path)
    if is_gguf(path):
        from jaxpd.models import gguf   # the gguf package only for GGUF files
        return gguf.read_config_and_tokenizer(path)
    cfg = ModelConfig.from_dir(path)
    has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return cfg, Tokenizer(path) if has_tokenizer else None
