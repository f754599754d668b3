"""How a chat request is planned for a harmony model (gpt-oss's template): the prompt's effort line, the stop
markers, special tokens kept in the text, the harmony output reader and its default reasoning format (no engine)."""

from __future__ import annotations

import pytest
from harmony_model import write_tokenizer

from waferscale.api.chat import validate_chat_request
from waferscale.api.errors import APIError
from waferscale.api.harmony_output import HarmonyOutput
from waferscale.api.pipeline import ServingContext
from waferscale.models.chat_template import ChatTemplate
from waferscale.models.tokenizer import ModelTokenizer

MODEL = "gpt-oss-20b"
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> ServingContext:
    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    write_tokenizer(folder)
    tok = ModelTokenizer.from_hf_folder(folder, {"model_type": "gpt_oss"})
    context = ServingContext(
        engine=None,
        tokenizer=tok,
        served_names=[MODEL],
        max_model_len=4096,
        vocab_size=tok.vocab_size,
        fingerprint="",
    )
    context.chat_template = ChatTemplate.for_tokenizer(tok)
    return context


def plan(ctx, **body):
    from waferscale.api.chat import plan_chat

    return plan_chat(validate_chat_request({"model": MODEL, "messages": ASK, **body}), ctx)


def test_a_harmony_plan_reads_channels_and_stops_at_return_and_call(ctx):
    p = plan(ctx)
    assert p.output is HarmonyOutput and p.syntax.name == "harmony"
    assert p.params.skip_special_tokens is False
    assert {"<|return|>", "<|call|>"} <= set(p.params.stop)
    assert p.reasoning_format == "text_parsed"  # the hosted default for gpt-oss
    assert p.params.lark is None  # nothing to constrain: the model writes harmony itself


@pytest.mark.parametrize(
    ("effort", "line"), [("low", "low"), ("high", "high"), ("none", "medium"), (None, "medium")]
)
def test_effort_is_the_reasoning_line(ctx, effort, line):
    p = plan(ctx, **({"reasoning_effort": effort} if effort else {}))
    assert f"\nReasoning: {line}\n" in p.prompt_text


def test_disable_reasoning_leaves_gpt_oss_reasoning(ctx):
    assert "\nReasoning: medium\n" in plan(ctx, disable_reasoning=True).prompt_text


def test_user_stop_sequences_are_kept_beside_the_markers(ctx):
    assert plan(ctx, stop=["END"]).params.stop == ["END", "<|return|>", "<|call|>"]


def test_raw_reasoning_cannot_go_with_a_json_format(ctx):
    with pytest.raises(APIError) as info:
        plan(ctx, reasoning_format="raw", response_format={"type": "json_object"})
    assert info.value.param == "reasoning_format"


def test_a_json_format_is_a_harmony_grammar(ctx):
    lark = plan(ctx, response_format={"type": "json_object"}).params.lark
    assert lark.startswith("start: analysis* (final)") and "<|channel|>" in lark
