"""The official Cerebras SDK and the OpenAI SDK against a real server: the reference page's example and streaming.
Each test runs against the single process and against engine replicas on Ray (marker `ray`)."""

from __future__ import annotations

import httpx
import pytest
from conftest import ALIAS, MODEL, cerebras_for, openai_for

PROMPT = "It was a dark and stormy night"


@pytest.fixture(params=["single", pytest.param("ray", marks=pytest.mark.ray)])
def endpoint(request):
    """The single-process server, or the front of engine replicas on a local Ray cluster."""
    return request.getfixturevalue("server" if request.param == "single" else "ray_server")


@pytest.fixture(params=["single", pytest.param("ray", marks=pytest.mark.ray)])
def endpoint_f32(request):
    """The same at float32 (the replicas' dtype already), for tests that compare two requests' answers: the second
    finds the prompt in the prefix cache, which in bfloat16 can round otherwise (docs/api.md, "Repeatable answers")."""
    return request.getfixturevalue("server_f32" if request.param == "single" else "ray_server")


@pytest.fixture
def cerebras(endpoint):
    with cerebras_for(endpoint.url) as client:
        yield client


@pytest.fixture
def openai_client(endpoint):
    with openai_for(endpoint.url) as client:
        yield client


def joined(tokens: list[str]) -> str:
    """The text that logprobs token names spell: a `bytes:\\xNN...` name stands for its raw bytes (part of a character)."""
    raw = b"".join(
        bytes(int(h, 16) for h in t[len("bytes:") :].split("\\x")[1:]) if t.startswith("bytes:") else t.encode()
        for t in tokens
    )
    return raw.decode("utf-8", "replace")


def test_reference_example_parses_with_strict_validation(cerebras):
    completion = cerebras.completions.create(prompt=PROMPT, max_tokens=100, model=ALIAS, logprobs=5, seed=11)
    assert completion.object == "text_completion"
    assert completion.model == ALIAS
    choice = completion.choices[0]
    assert choice.index == 0
    assert choice.finish_reason in ("length", "stop")
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) > 0
    assert lp.text_offset[0] == len(PROMPT) == 30
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (5, 6)
        assert top[token] == logprob  # the sampled token is always listed
    assert joined(lp.tokens) == choice.text
    usage = completion.usage
    assert usage.prompt_tokens == 7
    assert usage.completion_tokens >= n
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    t = completion.time_info
    assert t.total_time >= t.queue_time >= 0 and t.prompt_time > 0 and t.completion_time > 0 and t.created > 0


def test_cerebras_sdk_streams_the_same_text(endpoint_f32):
    with cerebras_for(endpoint_f32.url) as cerebras:
        full = cerebras.completions.create(prompt=PROMPT, max_tokens=24, model=MODEL, temperature=0)
        chunks = list(
            cerebras.completions.create(prompt=PROMPT, max_tokens=24, model=MODEL, temperature=0, stream=True)
        )
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_openai_sdk_completion_and_stream(endpoint_f32):
    with openai_for(endpoint_f32.url) as openai_client:
        full = openai_client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2
        )
        stream = openai_client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    assert full.choices[0].logprobs.text_offset[0] == 30
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_sdk_client_construction_warms_tcp(endpoint):
    from cerebras.cloud.sdk import Cerebras

    seen = []
    hooks = {"response": [lambda r: seen.append((r.request.url.path, r.status_code))]}
    with httpx.Client(event_hooks=hooks) as http_client:
        Cerebras(api_key="x", base_url=endpoint.url, http_client=http_client, max_retries=0)
    assert ("/v1/tcp_warming", 200) in seen


def test_sdk_maps_unknown_model_to_not_found(cerebras):
    from cerebras.cloud.sdk import NotFoundError

    with pytest.raises(NotFoundError) as info:
        cerebras.completions.create(prompt="hi", model="no-such-model", max_tokens=1)
    assert MODEL in str(info.value) and ALIAS in str(info.value)


def test_sdk_maps_context_overflow_to_bad_request(cerebras):
    from cerebras.cloud.sdk import BadRequestError

    with pytest.raises(BadRequestError) as info:
        cerebras.completions.create(prompt=PROMPT, model=MODEL, max_tokens=9000)
    assert "9000" in str(info.value) and "8192" in str(info.value)
