"""ReasoningSplitter: <think>...</think> split into reasoning and content, incrementally."""

from __future__ import annotations

import pytest

from waferscale.api.reasoning import ReasoningSplitter, prompt_opens_reasoning

QWEN3 = "<think>\nThe user greets me. I answer.\n</think>\n\nHello! How can I help?"
SAMPLES = [
    # (text, in_reasoning, expected reasoning, expected content)
    (QWEN3, False, "\nThe user greets me. I answer.\n", "Hello! How can I help?"),
    ("Plain answer, no tags.", False, "", "Plain answer, no tags."),
    ("Plain < answer <th <think", False, "", "Plain < answer <th <think"),  # a partial tag at the end is text
    ("lead <think>r</think>  \n c <think>x</think>", False, "r", "lead c <think>x</think>"),
    ("Okay, so 2+2 is 4.\n</think>\n\n4", True, "Okay, so 2+2 is 4.\n", "4"),
    ("still thinking when cut off </thi", True, "still thinking when cut off </thi", ""),
    ("<think></think>\n\n\n", False, "", ""),
    ("<think>a < b </ c </think>x", False, "a < b </ c ", "x"),
    ("</think>answer", True, "", "answer"),
]


def _one_feed(text: str, in_reasoning: bool) -> tuple[str, str]:
    s = ReasoningSplitter(in_reasoning=in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def _pieces(pieces: list[str], in_reasoning: bool) -> tuple[str, str]:
    s = ReasoningSplitter(in_reasoning=in_reasoning)
    reasoning = content = ""
    for p in pieces:
        r, c = s.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", SAMPLES)
def test_one_feed(text, in_reasoning, reasoning, content):
    assert _one_feed(text, in_reasoning) == (reasoning, content)
    assert ReasoningSplitter(in_reasoning=in_reasoning).split(text) == (reasoning, content)


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", SAMPLES)
def test_every_split_point(text, in_reasoning, reasoning, content):
    for i in range(len(text) + 1):
        assert _pieces([text[:i], text[i:]], in_reasoning) == (reasoning, content), i
    for i in range(len(text) + 1):
        for j in range(i, min(len(text), i + 12) + 1):  # three pieces, the middle one short (a tag cut twice)
            assert _pieces([text[:i], text[i:j], text[j:]], in_reasoning) == (reasoning, content), (i, j)


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", SAMPLES)
def test_character_by_character(text, in_reasoning, reasoning, content):
    assert _pieces(list(text), in_reasoning) == (reasoning, content)


def test_partial_tag_is_held_back_then_released():
    s = ReasoningSplitter()
    assert s.feed("Hi <thi") == ("", "Hi ")
    assert s.feed("nk>why") == ("why", "")
    assert s.in_reasoning
    assert s.feed("</") == ("", "")
    assert s.feed("think>") == ("", "")
    assert s.reasoning_closed and not s.in_reasoning
    assert s.feed("\n") == ("", "")
    assert s.feed("\nDone") == ("", "Done")
    assert s.feed("\n") == ("", "\n")  # only whitespace right after the tag goes
    assert s.finish() == ("", "")

    s = ReasoningSplitter()
    assert s.feed("a <thin") == ("", "a ")
    assert s.feed("g") == ("", "<thing")  # not a tag after all
    assert s.feed(" <t") == ("", " ")
    assert s.finish() == ("", "<t")

    s = ReasoningSplitter(in_reasoning=True)
    assert s.feed("deep </think") == ("deep ", "")
    assert s.finish() == ("</think", "")  # cut off inside the end tag: it stays reasoning


def test_custom_tags():
    s = ReasoningSplitter(start="<|begin_of_thought|>", end="<|end_of_thought|>")
    assert s.split("<|begin_of_thought|>hmm<|end_of_thought|> ok") == ("hmm", "ok")


def test_prompt_opens_reasoning():
    assert not prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")  # DeepSeek-R1
    assert prompt_opens_reasoning("...<think>")
    assert not prompt_opens_reasoning("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<think>old</think>\n<|im_start|>assistant\n")
    assert prompt_opens_reasoning("[T]", start="[T]", end="[/T]")
