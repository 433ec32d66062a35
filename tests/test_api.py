"""The public API on the built-in default model: no arguments needed, text in, text out."""
import pytest

import jaxpd
from jaxpd import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_one_shot_generate_with_the_default_model():
    outs = jaxpd.generate(["The list type", "Return the"],
                          SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                          mesh="prefill=1,decode=1", max_model_len=64)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.text and o.finish_reason == "length" for o in outs)
    assert outs[0].prompt_token_ids[0] == 1          # BOS from the shipped tokenizer


def test_text_and_token_prompts_agree_and_stream_text_adds_up():
    with LLM(mesh="prefill=2,decode=2", max_model_len=64) as llm:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        by_text = llm.generate("import", params)[0]
        by_ids = llm.generate(prompt_token_ids=[by_text.prompt_token_ids], sampling_params=params)[0]
        assert by_ids.token_ids == by_text.token_ids
        streamed = list(llm.stream("import", params))
        assert "".join(d.text for d in streamed) == by_text.text
        assert streamed[-1].finish_reason == by_text.finish_reason


def test_the_default_dtype_is_float32_on_cpu():
    with LLM(mesh="colocated=1", max_model_len=32) as llm:
        assert llm.config.dtype == "float32"
        assert llm.engine.decode_runner.k_pool.dtype == "float32"
