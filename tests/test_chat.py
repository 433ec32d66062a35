"""Chat templates (`jaxpd.chat`) and `LLM.chat` on the built-in default model."""
import pytest

from jaxpd import LLM, SamplingParams, default_model_dir
from jaxpd.chat import ChatTemplateError, check_messages, render_chat
from jaxpd.models.tokenizer import Tokenizer
from tests.engine_fixtures import XlaCompiles

# The shape of a real instruct template (ChatML-like): system/user/assistant turns,
# the generation prompt, a refusal through raise_exception, a bos token and tojson.
CHATML = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a colour."}]


def test_renders_system_user_assistant_and_the_generation_prompt():
    text = render_chat(CHATML, CONVERSATION, bos_token="<s>")
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n"
                    "<|im_start|>user\nName a colour.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    without = render_chat(CHATML, CONVERSATION, bos_token="<s>", add_generation_prompt=False)
    assert text == without + "<|im_start|>assistant\n"


def test_trim_blocks_lstrip_blocks_and_tojson_as_transformers():
    template = ("{% for m in messages %}\n"
                "    {{ m['content'] | tojson }}\n"
                "{% endfor %}")
    # trim_blocks eats the newline after a tag, lstrip_blocks the indent before one;
    # tojson keeps non-ASCII and does not HTML-escape.
    assert render_chat(template, [{"role": "user", "content": "café <b>"}]) == \
        '    "café <b>"\n'


def test_raise_exception_in_the_template_is_a_value_error():
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        render_chat(CHATML, [{"role": "tool", "content": "42"}])


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",            # immutable: the caller's list is not changed
    "{{ cycler.__init__.__globals__ }}",
])
def test_the_sandbox_refuses_escapes(attack):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="unsafe|failed"):
        render_chat(attack, messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_no_template_bad_roles_and_content_are_value_errors():
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(None, CONVERSATION)
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        check_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string"):
        check_messages([{"role": "user", "content": "x"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="messages is empty"):
        check_messages([])
    with pytest.raises(ValueError, match="messages must be a list"):
        check_messages("hello")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", CONVERSATION)


def test_the_default_model_has_a_template():
    tok = Tokenizer(default_model_dir())
    text = render_chat(tok.chat_template, CONVERSATION, eos_token="</s>")
    assert text == ("Be brief.\nUser: Hi\nAssistant: Hello.</s>\nUser: Name a colour.\n"
                    "Assistant:")
    assert tok.encode("Hello.</s>")[-1] == 2   # the eos string is the eos token


@pytest.fixture(scope="module")
def llm():
    """The built-in model at the library's defaults but for the sizes: warm-up and kept
    executables on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPD_KEEP_EXECUTABLES", "1")      # off for the rest of the suite
        with LLM(mesh="colocated=1", max_model_len=64, slots_per_shard=2) as llm:
            yield llm


@pytest.mark.slow
def test_llm_chat_is_generate_on_the_rendered_prompt(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with XlaCompiles(on_request_threads=True) as xla:
        (out,) = llm.chat(CONVERSATION, params)
    assert xla.count == 0                                 # served by warm-up's programs
    (ref,) = llm.generate(llm.chat_prompt(CONVERSATION), params)
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert out.prompt_token_ids == llm.tokenizer.encode(
        "Be brief.\nUser: Hi\nAssistant: Hello.</s>\nUser: Name a colour.\nAssistant:")
    # a batch of conversations: one output each, in order
    other = [{"role": "user", "content": "What is a string?"}]
    batch = llm.chat([CONVERSATION, other], params)
    assert [o.token_ids for o in batch] == [out.token_ids,
                                            llm.chat(other, params)[0].token_ids]


@pytest.mark.slow
def test_llm_chat_refuses_bad_messages(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        llm.chat([{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match=r"content must be a string"):
        llm.chat([{"role": "user", "content": None}])


def test_llm_chat_without_a_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONVERSATION)


TOOL_TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                 "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
                 "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
                 "{% if think is defined %}({{ think }}){% endif %};{% endfor %}")


def test_tools_calls_and_template_kwargs_reach_the_template():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"a": "ü"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "y"}]
    assert render_chat(TOOL_TEMPLATE, messages, tools=tools, template_kwargs={"think": 0}) == \
        '[f]user:x(0);assistant:{"a": "ü"}(0);tool:y(0);'
    assert render_chat(TOOL_TEMPLATE, messages[:1]) == "user:x;"   # no tools: unset


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": None, "tool_calls": []}], r"messages\[0\]\.tool_calls: only"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     r"messages\[0\]\.tool_calls\[0\] must be"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}], "must be a JSON object"),
    ([{"role": "assistant", "content": None}], r"messages\[0\]\.content must be a string"),
])
def test_bad_tool_calls_in_messages_are_value_errors(messages, match):
    with pytest.raises(ValueError, match=match):
        check_messages(messages)


def test_template_kwargs_cannot_replace_what_the_renderer_sets():
    with pytest.raises(ValueError, match="chat_template_kwargs: messages, tools"):
        render_chat(CHATML, CONVERSATION, template_kwargs={"tools": [], "messages": []})
