"""Qwen3, Gemma 2/3 and the mixtures of experts served end to end: greedy tokens equal
transformers' on the same tiny random weights, on disaggregated and colocated meshes,
with prefix caching on and off; their configs and checkpoints are checked at load."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd import LLM, SamplingParams
from jaxpd.models import checkpoint
from jaxpd.models.config import ModelConfig
from jaxpd.models.llama import Llama
from tests.engine_fixtures import assert_all_pages_free
from tests.hf_fixtures import hf_greedy, hf_logits

FAMILIES = ["qwen3", "gemma3", "gemma2", "qwen3_moe", "mixtral", "qwen2_moe"]
# One token, around the 8-token window of the Gemma fixtures, across pages (16) and
# buckets, and a prompt whose decode runs far past the window.
LENGTHS = (1, 7, 8, 9, 17, 40)
NUM_NEW = 6
MESHES = ["prefill=2,decode=2", "prefill=2,decode=2x2", "colocated=4"]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in LENGTHS]


def _greedy(llm, prompts):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[params] * len(prompts))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_logits_match_transformers(hf_models, name):
    path, hf_model = hf_models(name)
    loaded = checkpoint.load(path)
    tokens = _prompts(loaded.cfg.vocab_size)[-1]
    ours = Llama(loaded.cfg).apply({"params": loaded.params}, jnp.asarray([tokens]),
                                   method=Llama.forward)[0]
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf_model, tokens), atol=1e-4,
                               rtol=1e-4)


def _serve(path, mesh, prefix_caching, prompts):
    with LLM(path, mesh=mesh, max_model_len=64, slots_per_shard=2,
             enable_prefix_caching=prefix_caching) as llm:
        got = _greedy(llm, prompts)
        # Again: with the cache on, the second pass reuses the first's pages.
        again = _greedy(llm, prompts)
        assert_all_pages_free(llm)
    return got, again


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3_moe"])
def test_greedy_matches_transformers_disaggregated(hf_models, name):
    """One fast representative per family on prefill=2,decode=2 (the decode mesh's
    experts spread over tp only where it has tp: see the slow matrix)."""
    path, hf_model = hf_models(name)
    prompts = _prompts(256)
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    got, again = _serve(path, "prefill=2,decode=2", True, prompts)
    assert got == expected
    assert again == expected


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_matches_transformers_on_every_mesh(hf_models, name, mesh, prefix_caching):
    if mesh.startswith("colocated") and prefix_caching:
        pytest.skip("colocated meshes run every prefill with context already")
    path, hf_model = hf_models(name)
    prompts = _prompts(256, seed=1)
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    got, again = _serve(path, mesh, prefix_caching, prompts)
    assert got == expected
    assert again == expected
