"""The harmony tool-call syntax (gpt-oss): its grammars compiled by llguidance over a tokenizer with harmony's
special tokens and run through matchers, and its parser (no model, no server)."""

from __future__ import annotations

import llguidance
import pytest
from harmony_model import harmony_tokenizer

from waferscale.api.tools import format_grammar, grammar_special_tokens, parse_tool_calls, tool_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "a",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
}
THINK = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
FINAL = "<|channel|>final<|message|>It is sunny.<|return|>"

TOK = harmony_tokenizer()
SPECIALS = grammar_special_tokens(TOK)
STOPS = [TOK.token_to_id(t) for t in ("<|return|>", "<|call|>")]
LL = llguidance.LLTokenizer(TOK.to_str(), n_vocab=TOK.get_vocab_size(), eos_token=STOPS)


def accepts(grammar: str, text: str) -> bool:
    """`text` is a whole output the grammar allows, tokenized as the model emits it, the grammar done at its end."""
    m = llguidance.LLMatcher(LL, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(TOK.encode(text, add_special_tokens=False).ids) and m.is_stopped()


def grammar(choice, tools=(WEATHER, TIME), **kwargs) -> str:
    return tool_grammar(list(tools), choice, True, "harmony", special_tokens=SPECIALS, **kwargs)


def test_the_markers_are_special_tokens_the_grammar_names():
    assert {"<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>"} <= SPECIALS
    assert "<|channel|> " in grammar("required") and '"<|channel|>"' not in grammar("required")


@pytest.mark.parametrize("reasoning", ["", THINK, THINK + THINK])
def test_required_is_one_call_after_any_reasoning(reasoning):
    assert accepts(grammar("required"), reasoning + CALL)
    assert not accepts(grammar("required"), reasoning + FINAL)


def test_a_call_ends_at_call_and_nothing_follows():
    assert not accepts(grammar("required"), CALL.removesuffix("<|call|>"))
    assert not accepts(grammar("required"), CALL + "<|start|>assistant" + CALL)


def test_arguments_follow_the_tool_schema():
    assert not accepts(grammar("required"), CALL.replace("Paris", "Rome"))


def test_named_choice_calls_only_that_function():
    named = grammar({"type": "function", "function": {"name": "get_time"}})
    assert not accepts(named, CALL)
    assert accepts(named, THINK + CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}"))


def test_auto_answers_or_calls_none_only_answers():
    assert accepts(grammar("auto"), THINK + CALL) and accepts(grammar("auto"), THINK + FINAL)
    assert accepts(grammar("none"), THINK + FINAL) and not accepts(grammar("none"), THINK + CALL)


def test_response_format_holds_the_final_message_only():
    held = format_grammar(ANSWER, "harmony", SPECIALS)
    assert accepts(held, THINK + '<|channel|>final<|message|>{"ok": true}<|return|>')
    assert not accepts(held, THINK + FINAL)
    with_tools = grammar("auto", response_format=ANSWER)
    assert accepts(with_tools, THINK + CALL)
    assert accepts(with_tools, '<|channel|>final<|message|>{"ok": false}<|return|>')


def test_without_harmony_tokens_the_markers_are_text():
    text = tool_grammar([WEATHER], "required", True, "harmony")
    assert '"<|channel|>"' in text
    assert llguidance.LLMatcher.validate_grammar(text) == ""


def test_parse_reads_the_call_in_both_header_orders():
    assert parse_tool_calls(THINK + CALL, "harmony") == (
        None,
        [{"name": "get_weather", "arguments": '{"city":"Paris"}'}],
    )
    history_form = "<|channel|>commentary to=functions.get_time json<|message|>{ }<|call|>"
    assert parse_tool_calls(history_form, "harmony")[1] == [{"name": "get_time", "arguments": "{}"}]
    recipient_first = " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
    assert parse_tool_calls(recipient_first, "harmony")[1] == [{"name": "get_time", "arguments": "{}"}]


def test_parse_without_a_call_is_the_final_text():
    assert parse_tool_calls(THINK + FINAL, "harmony") == ("It is sunny.", [])
