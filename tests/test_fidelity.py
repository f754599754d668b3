"""At float32 our greedy tokens and logprobs equal Hugging Face transformers' on the same GGUF weights."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import MODEL

PROMPTS = [
    "The history of the Roman Empire is long and complicated. It began when Augustus became the first emperor, "
    "and over the next centuries the empire grew to cover most of Europe, North Africa and the Middle East, "
    "until",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively so that large values of '
    'n do not overflow the recursion limit of the Python interpreter."""\n    a, b = 0, 1\n',
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain in two sentences why the sky looks blue during the day and red at sunset."
    "<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(hf_reference, hf_tokenizer):
    return hf_reference, hf_tokenizer


@pytest.mark.parametrize("prompt", PROMPTS, ids=["history", "code", "chat"])
def test_greedy_tokens_and_logprobs_match_transformers(server_f32, reference, prompt):
    model, tokenizer = reference
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) >= 40
    body = {
        "model": MODEL,
        "prompt": prompt_ids,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "return_raw_tokens": True,
    }
    with httpx.Client(base_url=server_f32.url, timeout=300) as http:
        out = http.post("/v1/completions", json=body).json()
    ours = out["choices"][0]["tokens"]
    our_logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=2,
            pad_token_id=2,
        )
    theirs = gen.sequences[0, len(prompt_ids) :].tolist()
    if theirs and theirs[-1] == 2:  # EOS ends generation; it is not returned as a token
        theirs = theirs[:-1]
    assert len(theirs) > 5
    assert ours == theirs
    ref_logprobs = [float(s[0].log_softmax(-1)[t]) for s, t in zip(gen.scores, theirs)]
    assert max(abs(a - b) for a, b in zip(our_logprobs, ref_logprobs)) < 1e-4


def test_string_prompts_tokenize_as_transformers_does(server_f32, reference):
    _, tokenizer = reference
    with httpx.Client(base_url=server_f32.url, timeout=300) as http:
        for prompt in PROMPTS + ["Numbers 12345 and   spaces\n\n\ttabs, émigré 😀"]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
            out = http.post("/v1/completions", json=body).json()
            expected = tokenizer(prompt)["input_ids"]
            assert out["usage"]["prompt_tokens"] == len(expected)
            assert out["choices"][0]["text"] == prompt
            tokens = out["choices"][0]["logprobs"]["tokens"]
            assert [_as_text(t) for t in tokens] == [tokenizer.decode([t]) for t in expected]
            assert any(t.startswith("bytes:") for t in tokens) == prompt.endswith("😀")  # part of a character


def _as_text(name: str) -> str:
    """A logprobs token name as text: `bytes:\\xNN...` (a token that is not whole UTF-8) decodes with U+FFFD."""
    if not name.startswith("bytes:"):
        return name
    return bytes.fromhex(name[len("bytes:") :].replace("\\x", "")).decode("utf-8", "replace")
