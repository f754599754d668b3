"""gpt-oss's chat template (harmony) rendered by waferscale, token for token as transformers' apply_chat_template
renders it: system and developer instructions, tools, reasoning_effort, earlier turns with reasoning, tool calls and
tool results. The tokenizer is tests/harmony_model.py's (harmony's special tokens on a small BPE)."""

from __future__ import annotations

import pytest
from harmony_model import write_tokenizer

from waferscale.models.chat_template import ChatTemplate
from waferscale.models.default_templates import default_chat_template, gpt_oss_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {}}}
CALL = {
    "id": "call1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CONVERSATION = [
    {"role": "developer", "content": "Answer in one sentence."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(ours: template and tokenizer, transformers' tokenizer) over the same files."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    tok = write_tokenizer(folder)
    return ChatTemplate(gpt_oss_template()), tok, AutoTokenizer.from_pretrained(str(folder))


def _both(tokenizers, messages, **kwargs) -> tuple[list[int], list[int]]:
    template, tok, hf = tokenizers
    ours = tok.encode(template.render(messages, **kwargs), add_special_tokens=False).ids
    theirs = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return ours, theirs["input_ids"] if hasattr(theirs, "keys") else theirs


def test_the_template_is_recognised_as_harmony():
    t = ChatTemplate(gpt_oss_template())
    assert (t.harmony, t.reasoning, t.tool_syntax, t.supports_tools, t.supports_developer) == (
        True, True, "harmony", True, True,
    )  # fmt: skip


def test_a_gpt_oss_model_without_a_template_gets_gpt_oss_s():
    assert default_chat_template("gpt_oss") == default_chat_template("gpt-oss") == gpt_oss_template()


@pytest.mark.parametrize("effort", [None, "low", "medium", "high"])
def test_conversation_with_tools_renders_token_identical(tokenizers, effort):
    kwargs = {"tools": [WEATHER, NOW]} | ({"reasoning_effort": effort} if effort else {})
    ours, theirs = _both(tokenizers, CONVERSATION, **kwargs)
    assert ours == theirs


def test_effort_is_the_reasoning_line_of_the_system_message(tokenizers):
    text = tokenizers[0].render(CONVERSATION[1:2], reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "\nReasoning: high\n" in text
    assert "\nReasoning: medium\n" in tokenizers[0].render(CONVERSATION[1:2])  # the model's default


def test_system_message_becomes_developer_instructions(tokenizers):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    ours, theirs = _both(tokenizers, messages)
    assert ours == theirs
    text = tokenizers[0].render(
        messages
    )  # the template ends instructions with a blank line (openai-harmony does not)
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n<|end|>" in text


def test_finished_turns_drop_their_reasoning_an_open_tool_turn_keeps_it(tokenizers):
    text = tokenizers[0].render(CONVERSATION, tools=[WEATHER])
    assert "Greet back." not in text  # the turn ended with a final answer
    assert "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
        "<|start|>assistant"
    ) in text
    assert text.endswith("<|start|>assistant")


def test_a_later_final_answer_drops_the_tool_turn_s_reasoning_too(tokenizers):
    messages = [
        *CONVERSATION,
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Ok"},
    ]
    ours, theirs = _both(tokenizers, messages, tools=[WEATHER])
    assert ours == theirs
    assert "Need the tool." not in tokenizers[0].render(messages, tools=[WEATHER])


def test_parallel_calls_become_one_call_per_message_each_with_its_result(tokenizers):
    second = {"id": "call2", "type": "function", "function": {"name": "now", "arguments": {}}}
    parallel = [
        CONVERSATION[3],
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two tools.",
            "tool_calls": [CALL, second],
        },
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call2", "content": "noon"},
    ]
    split = [
        CONVERSATION[3],
        {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
        {"role": "assistant", "tool_calls": [second]},
        {"role": "tool", "tool_call_id": "call2", "content": "noon"},
    ]
    template, tok, hf = tokenizers
    ours = tok.encode(template.render(parallel, tools=[WEATHER, NOW]), add_special_tokens=False).ids
    assert (
        ours == _both(tokenizers, split, tools=[WEATHER, NOW])[1]
    )  # transformers renders only the first call
    assert '<|start|>functions.now to=assistant<|channel|>commentary<|message|>"noon"' in template.render(
        parallel, tools=[WEATHER, NOW]
    )


def test_every_system_and_developer_message_joins_the_instructions(tokenizers):
    scattered = [
        {"role": "system", "content": "Be terse."},
        {"role": "developer", "content": "Use metric units."},
        CONVERSATION[1],
        {"role": "system", "content": "Answer in French."},
    ]
    joined = [
        {"role": "developer", "content": "Be terse.\n\nUse metric units.\n\nAnswer in French."},
        CONVERSATION[1],
    ]
    template, tok, _ = tokenizers
    ours = tok.encode(template.render(scattered), add_special_tokens=False).ids
    assert ours == _both(tokenizers, joined)[1]  # transformers would keep only "Be terse."
