"""Checkpoints made for tests from a transformers model."""
import copy


def negated_copy(hf, path: str, layer: int = 0):
    """`hf` with one k_proj weight negated, saved at `path`: same shapes and dtypes,
    other KV (and other tokens)."""
    import torch

    other = copy.deepcopy(hf)
    with torch.no_grad():
        k = other.model.layers[layer].self_attn.k_proj.weight
        k.copy_(-k)
    other.save_pretrained(path)
    return other

