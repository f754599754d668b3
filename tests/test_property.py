"""Property-based: random valid requests get a 200 that validates against the spec's models; random invalid ones
get a 4xx in the right shape; nothing gets a 5xx and the server keeps answering."""

from __future__ import annotations

import json

from conftest import MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waferscale.api.schemas import (
    CompletionChoice,
    CompletionResponse,
    ErrorChunkResponse,
    HTTPValidationError,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
token = st.integers(0, 49151)
short_text = st.text(max_size=24)
prompt = st.one_of(
    short_text,
    st.lists(short_text, min_size=1, max_size=2),
    st.lists(token, min_size=1, max_size=8),
    st.lists(st.lists(token, min_size=1, max_size=6), min_size=1, max_size=2),
)


@st.composite
def valid_requests(draw):
    body = {"model": MODEL, "prompt": draw(prompt), "max_tokens": draw(st.integers(0, 3))}
    optional = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "n": st.integers(1, 2),
        "logprobs": st.none() | st.integers(0, 5),
        "echo": st.booleans(),
        "stop": st.none() | short_text | st.lists(short_text, max_size=4),
        "seed": st.none() | st.integers(-(2**70), 2**70),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(token.map(str), st.floats(-100, 100), max_size=3),
        "min_tokens": st.none() | st.integers(-1, 3),
        "user": st.none() | short_text,
        "prompt_cache_key": st.none() | short_text,
        "return_raw_tokens": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            body[key] = draw(strategy)
    if body.get("echo") and body.get("return_raw_tokens"):
        body["return_raw_tokens"] = False
    return body


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _number_within(text: str, low: float, high: float) -> bool:
    """Whether a string reads as a number in [low, high] (a valid value: numbers may come as strings, as pydantic's
    lax mode takes them)."""
    try:
        return low <= float(text) <= high
    except ValueError:
        return False


@st.composite
def invalid_requests(draw):
    kind = draw(st.sampled_from(["junk-field", "bad-value", "missing", "random-object"]))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    if kind == "junk-field":
        body[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in CompletionFields))] = draw(junk)
    elif kind == "bad-value":
        field = draw(
            st.sampled_from(
                [
                    "temperature",
                    "top_p",
                    "n",
                    "logprobs",
                    "max_tokens",
                    "best_of",
                    "stop",
                    "frequency_penalty",
                    "prompt",
                    "model",
                    "echo",
                    "logit_bias",
                    "grammar_root",
                ]
            )
        )
        body[field] = draw(
            {
                "temperature": st.floats(2.01, 1e9)
                | st.floats(max_value=-0.01)
                | st.text(min_size=1).filter(lambda s: not _number_within(s, 0, 2)),
                "top_p": st.floats(1.01, 1e9),
                "n": st.integers(max_value=0),
                "logprobs": st.integers(21, 10**6),
                "max_tokens": st.integers(max_value=-2) | st.integers(9000, 10**12),
                "best_of": st.integers(21, 1000),
                "stop": st.lists(st.text(max_size=3), min_size=5, max_size=8),
                "frequency_penalty": st.floats(2.01, 100),
                "prompt": st.lists(st.integers(max_value=-1), min_size=1, max_size=3)
                | st.lists(st.integers(49152, 2**40), min_size=1, max_size=3)
                | st.just([]),
                "model": st.text(max_size=10).filter(lambda m: m != MODEL) | st.integers(),
                "echo": st.text(min_size=2).filter(
                    lambda s: s.lower() not in ("true", "false", "yes", "no", "on", "off")
                ),
                "logit_bias": st.dictionaries(
                    st.text(min_size=1, max_size=5).filter(lambda k: not k.strip().isdigit()),
                    st.floats(-1, 1),
                    min_size=1,
                    max_size=2,
                ),
                "grammar_root": st.text(min_size=1, max_size=8).filter(lambda r: r not in GrammarRoots),
            }[field]
        )
    elif kind == "missing":
        del body[draw(st.sampled_from(["model", "prompt"]))]
    else:
        body = draw(st.dictionaries(st.text(max_size=8), junk, max_size=4))
    return body


CompletionFields = set(__import__("waferscale.api.schemas", fromlist=["x"]).CompletionRequest.model_fields)
GrammarRoots = set(__import__("waferscale.api.schemas", fromlist=["x"]).GRAMMAR_ROOTS)


@SETTINGS
@given(body=valid_requests())
def test_valid_requests_get_responses_that_validate(http, body):
    if body.get("stream"):
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        for raw in data[:-1]:
            chunk = json.loads(raw)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                CompletionChoice.model_validate(choice)
        return
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = CompletionResponse.model_validate(r.json())
    prompts = (
        1 if isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int) else len(body["prompt"])
    )
    assert len(out.choices) == prompts * body.get("n", 1)
    assert sorted(c.index for c in out.choices) == list(range(len(out.choices)))


@SETTINGS
@given(body=invalid_requests())
def test_invalid_requests_get_a_4xx_in_the_right_shape(http, body):
    # sent as Python's json writes it, NaN and Infinity included (the server's decoder must cope)
    r = http.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    if r.status_code == 422:
        HTTPValidationError.model_validate(r.json())
    else:
        err = ErrorChunkResponse.model_validate(r.json())
        assert err.status_code == r.status_code and err.error.message


def test_server_still_answers_after_the_properties(http):
    assert http.get("/health").status_code == 200
    assert (
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code
        == 200
    )
