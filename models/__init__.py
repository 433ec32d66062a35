"""Flax Llama-family model: config, forward passes, paged attention, loading."""
from models.config import ModelConfig
from models.llama import Llama

__all__ = ["ModelConfig", "Llama"]
