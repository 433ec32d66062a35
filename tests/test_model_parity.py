"""The Flax model equals Hugging Face transformers on the same (tiny, random) weights."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.models import checkpoint
from jaxpd.models.llama import Llama
from tests.hf_fixtures import CONFIGS, hf_greedy, hf_logits
from tests.model_helpers import paged_greedy

pytestmark = pytest.mark.slow

EDGE_LENGTHS = (1, 16, 17)   # a page is 16 here: one token, and both sides of its edge
NUM_NEW = 24


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_pair(request, hf_models):
    path, hf_model = hf_models(request.param)
    return hf_model, checkpoint.load(path)


def _prompt(n, vocab, seed=0):
    return np.random.default_rng(seed + n).integers(3, vocab, size=n).tolist()


def test_prefill_logits_match(hf_pair):
    hf_model, loaded = hf_pair
    tokens = _prompt(40, loaded.cfg.vocab_size)
    ours = Llama(loaded.cfg).apply({"params": loaded.params}, jnp.asarray([tokens]),
                                   method=Llama.forward)[0]
    np.testing.assert_allclose(np.asarray(ours), hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


def test_paged_greedy_matches_hf_generate(hf_pair):
    """Every family, a prompt of several pages."""
    hf_model, loaded = hf_pair
    prompt = _prompt(100, loaded.cfg.vocab_size)
    ours, _ = paged_greedy(loaded.cfg, loaded.params, prompt, NUM_NEW)
    assert ours == hf_greedy(hf_model, prompt, NUM_NEW)


@pytest.mark.parametrize("length", EDGE_LENGTHS)
def test_paged_greedy_at_page_edges_matches_hf_generate(hf_models, length):
    """Prompt lengths at the page edges (the paging is the same for every family)."""
    path, hf_model = hf_models("llama_gqa")
    loaded = checkpoint.load(path)
    prompt = _prompt(length, loaded.cfg.vocab_size)
    ours, _ = paged_greedy(loaded.cfg, loaded.params, prompt, NUM_NEW)
    assert ours == hf_greedy(hf_model, prompt, NUM_NEW)


def test_paged_decode_equals_full_forward(hf_pair):
    _, loaded = hf_pair
    prompt = _prompt(31, loaded.cfg.vocab_size)
    tokens, step_logits = paged_greedy(loaded.cfg, loaded.params, prompt, 20, page_size=8)
    full = Llama(loaded.cfg).apply({"params": loaded.params}, jnp.asarray([prompt + tokens]),
                                   method=Llama.forward)[0]
    # Decode step i consumed token i at position len(prompt)+i.
    expected = np.asarray(full[len(prompt):len(prompt) + len(step_logits)])
    np.testing.assert_allclose(step_logits, expected, atol=1e-4, rtol=1e-4)
