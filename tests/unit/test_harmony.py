"""The harmony output parser (gpt-oss): channels to reasoning, content and tool calls, piece by piece; examples
from the harmony format guide (openai/harmony docs/format.md, v0.0.8, as quoted in the project's reasoning spec)."""

from __future__ import annotations

import pytest

from waferscale.api.harmony import HarmonyParser

REASON_THEN_ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
TOOL_CALL = (
    "<|channel|>analysis<|message|>Need the price.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_price <|constrain|>json<|message|>{"symbol":"ACME"}'
    "<|call|>"
)


def _parse(text: str, piece: int) -> tuple[str, str, list[tuple[str, str]], str | None]:
    parser = HarmonyParser()
    deltas = []
    for i in range(0, len(text), piece):
        deltas += parser.feed(text[i : i + piece])
    deltas += parser.finish()
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning, content, [d.tool_call for d in deltas if d.tool_call], parser.ended


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_analysis_is_reasoning_and_final_is_content_however_the_text_is_cut(piece):
    assert _parse(REASON_THEN_ANSWER, piece) == ("User asks 2+2. Simple.", "2 + 2 = 4.", [], "<|return|>")


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_a_commentary_message_to_a_function_is_one_whole_tool_call(piece):
    assert _parse(TOOL_CALL, piece) == ("Need the price.", "", [("get_price", '{"symbol":"ACME"}')], "<|call|>")


def test_the_recipient_may_stand_beside_the_role():
    text = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_price'
            '<|channel|>commentary <|constrain|>json<|message|>{"symbol": "X"}<|call|>')
    assert _parse(text, 4)[2] == [("get_price", '{"symbol": "X"}')]


def test_a_commentary_message_without_recipient_is_a_preamble_for_the_user():
    text = "<|channel|>commentary<|message|>Let me check two things.<|end|>"
    assert _parse(text, 2)[1] == "Let me check two things."


def test_a_call_whose_stop_token_was_swallowed_still_ends_at_finish():
    assert _parse(TOOL_CALL.removesuffix("<|call|>"), 6)[2] == [("get_price", '{"symbol":"ACME"}')]


def test_text_after_the_stop_token_is_ignored():
    assert _parse(REASON_THEN_ANSWER + "garbage", 5)[1] == "2 + 2 = 4."


def test_a_lone_angle_bracket_in_content_is_text():
    text = "<|channel|>final<|message|>a <| b and 1 < 2<|return|>"
    assert _parse(text, 1)[1] == "a <| b and 1 < 2"
