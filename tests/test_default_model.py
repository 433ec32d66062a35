"""The shipped default model: transformers loads it and agrees with jaxpd, and it writes
words, not noise."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpd.default_model import default_model_dir
from jaxpd.models import checkpoint
from jaxpd.models.llama import Llama
from tests.hf_fixtures import hf_greedy
from tests.model_helpers import paged_greedy

PROMPTS = ("The list type", "Return the", "import")
NUM_NEW = 24
# Same word pattern as launch/default_corpus.py, which wrote the word list.
WORD_RE = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


@pytest.fixture(scope="module")
def loaded():
    return checkpoint.load(default_model_dir(), dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # bf16 weights upcast to float32, as jaxpd's loader does.
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


def forward_greedy(loaded, prompt: list[int], num_new: int) -> list[int]:
    """Greedy ids by full forwards over one fixed-size buffer (causal, so the zeros after
    the tokens don't matter, and one compile serves every step)."""
    model = Llama(loaded.cfg)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t, method=Llama.forward)[0])
    tokens = np.zeros((1, len(prompt) + num_new), np.int32)
    tokens[0, :len(prompt)] = prompt
    for pos in range(len(prompt), tokens.shape[1]):
        tokens[0, pos] = int(jnp.argmax(forward(loaded.params, jnp.asarray(tokens))[pos - 1]))
    return tokens[0, len(prompt):].tolist()


def test_shipped_files_are_small():
    files = os.listdir(default_model_dir())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training_log.json"):
        assert name in files
    total = sum(os.path.getsize(os.path.join(default_model_dir(), f)) for f in files)
    assert total <= 20 * 2**20


@pytest.mark.slow
def test_tokenizers_agree_and_round_trip(loaded, hf_tokenizer):
    text = "The list type supports x[i:j] -- and naïve café\ttabs.\n\n  Indented."
    ids = loaded.tokenizer.encode(text)
    assert ids[0] == loaded.cfg.bos_token_id and ids.count(loaded.cfg.bos_token_id) == 1
    assert ids == hf_tokenizer(text).input_ids
    assert loaded.tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(loaded, hf_model, prompt):
    ids = loaded.tokenizer.encode(prompt)
    expected = hf_greedy(hf_model, ids, NUM_NEW)
    assert forward_greedy(loaded, ids, NUM_NEW) == expected
    # The serving path (prefill, pages, paged decode) agrees too.
    assert paged_greedy(loaded.cfg, loaded.params, ids, NUM_NEW)[0] == expected


@pytest.mark.slow
def test_greedy_text_is_made_of_corpus_words(loaded):
    ids = forward_greedy(loaded, loaded.tokenizer.encode(PROMPTS[0]), NUM_NEW)
    # Not a degenerate loop on one token.
    assert max(ids.count(i) for i in ids) <= NUM_NEW // 2, ids
    text = loaded.tokenizer.decode(ids)
    with open(os.path.join(default_model_dir(), "corpus_words.txt")) as f:
        known = set(f.read().split())
    words = [w.lower() for w in WORD_RE.findall(text)]
    assert len(words) >= 5, text
    assert sum(w in known for w in words) >= 0.6 * len(words), text
