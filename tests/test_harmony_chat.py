"""gpt-oss's harmony format on /v1/chat/completions, through a real server and the official SDKs: a tiny random
model whose tokenizer has harmony's special tokens and whose chat template is gpt-oss's (tests/harmony_model.py),
its outputs held to shape by the grammar. Reasoning arrives in `reasoning`, a function call in `tool_calls`, a
JSON answer in `content`, in the hosted shapes, streamed and not; the prompt is gpt-oss's template rendered."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import Server, cerebras_for, openai_for, sse_events
from harmony_model import harmony_tokenizer, write_model

MODEL = "gpt-oss-120b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lyon"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "sunny": {"type": "boolean"},
                "city": {"type": "string", "enum": ["Paris", "Lyon"]},
            },
            "required": ["sunny", "city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    folder = write_model(tmp_path_factory.mktemp("harmony-model"))
    s = Server("--model", str(folder), "--served-model-name", MODEL, "--dtype", "float32")
    yield s
    s.stop()


# logit_bias that makes the random model end a message after a few tokens of text (it would ramble on to the limit)
END_BIAS = {str(harmony_tokenizer().token_to_id(t)): 4 for t in ("<|end|>", "<|return|>")}
SEED = 0  # a seed whose analysis is not empty for the requests here


@pytest.fixture
def http(harmony_server):
    with httpx.Client(base_url=harmony_server.url, timeout=120) as client:
        yield client


def request(**body) -> dict:
    return {
        "model": MODEL,
        "messages": ASK,
        "max_completion_tokens": 300,
        "seed": SEED,
        "logit_bias": END_BIAS,
        "reasoning_effort": "low",
        **body,
    }


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json=request(**body))
    assert r.status_code == 200, r.text
    return r.json()


def assert_call(call: dict, tools: list[dict]) -> None:
    """A tool call in the hosted shape, its arguments a JSON string valid against its tool's schema."""
    import jsonschema

    assert set(call) >= {"id", "type", "function"} and call["type"] == "function"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["function"]["name"] in schemas
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


# ---------------------------------------------------------------- tool calls


def test_required_call_comes_after_the_reasoning(http):
    out = chat(http, tools=[WEATHER, TIME], tool_choice="required")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    assert isinstance(message["reasoning"], str) and message["reasoning"]
    (call,) = message["tool_calls"]
    assert_call(call, [WEATHER, TIME])
    details = out["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] < out["usage"]["completion_tokens"]


def test_named_choice_calls_that_function(http):
    out = chat(
        http, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert_call(call, [TIME])


def test_stream_carries_reasoning_deltas_then_the_whole_call(http):
    whole = chat(http, tools=[WEATHER], tool_choice="required")["choices"][0]["message"]
    events = sse_events(http, "/v1/chat/completions", **request(tools=[WEATHER], tool_choice="required"))
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant"}
    reasoning = [c["delta"]["reasoning"] for c in chunks[1:] if "reasoning" in c["delta"]]
    assert "".join(reasoning) == whole["reasoning"]
    (with_calls,) = [i for i, c in enumerate(chunks) if "tool_calls" in c["delta"]]
    assert with_calls > max(i for i, c in enumerate(chunks) if "reasoning" in c["delta"])
    (call,) = chunks[with_calls]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == whole["tool_calls"][0]["function"]
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"] == {}
    assert events[-2]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert not any("content" in c["delta"] for c in chunks)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_auto_answers_or_calls_in_the_hosted_shape(http, seed):
    choice = chat(http, tools=[WEATHER, TIME], seed=seed)["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert_call(call, [WEATHER, TIME])
    else:
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert isinstance(choice["message"]["content"], str)


def test_tool_choice_none_answers_on_the_final_channel(http):
    out = chat(http, tools=[WEATHER], tool_choice="none")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str)


def test_a_call_and_its_result_go_back_into_the_conversation(http):
    first = chat(http, tools=[WEATHER], tool_choice="required")["choices"][0]["message"]
    (call,) = first["tool_calls"]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "reasoning": first["reasoning"], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'},
    ]
    out = chat(http, messages=history, tools=[WEATHER], tool_choice="none", response_format=ANSWER)
    assert json.loads(out["choices"][0]["message"]["content"])["city"] in ("Paris", "Lyon")


# ---------------------------------------------------------------- structured outputs and reasoning formats


def test_response_format_holds_the_final_answer_after_the_reasoning(http):
    import jsonschema

    out = chat(http, response_format=ANSWER)
    message = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert message["reasoning"]
    jsonschema.validate(json.loads(message["content"]), ANSWER["json_schema"]["schema"])


def test_hidden_reasoning_is_still_counted(http):
    shown = chat(http, response_format=ANSWER)
    hidden = chat(http, response_format=ANSWER, reasoning_format="hidden")
    assert "reasoning" not in hidden["choices"][0]["message"]
    assert hidden["choices"][0]["message"]["content"] == shown["choices"][0]["message"]["content"]
    assert hidden["usage"] == shown["usage"] | {
        "prompt_tokens_details": hidden["usage"]["prompt_tokens_details"]
    }
    assert hidden["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_raw_reasoning_is_the_content_s_beginning_with_no_separator(http):
    parsed = chat(http, tools=[WEATHER], tool_choice="required")["choices"][0]["message"]
    raw = chat(http, tools=[WEATHER], tool_choice="required", reasoning_format="raw")["choices"][0]["message"]
    assert raw["content"] == parsed["reasoning"] and "reasoning" not in raw
    assert raw["tool_calls"][0]["function"] == parsed["tool_calls"][0]["function"]


def test_raw_reasoning_with_a_json_format_is_400(http):
    r = http.post("/v1/chat/completions", json=request(response_format=ANSWER, reasoning_format="raw"))
    assert r.status_code == 400 and r.json()["param"] == "reasoning_format"


def test_parsed_reasoning_has_its_own_logprobs(http):
    out = chat(http, response_format=ANSWER, reasoning_format="parsed", logprobs=True)
    choice = out["choices"][0]
    reasoning = choice["reasoning_logprobs"]["content"]
    assert len(reasoning) == out["usage"]["completion_tokens_details"]["reasoning_tokens"]
    content = "".join(e["token"] for e in choice["logprobs"]["content"])
    assert content == choice["message"]["content"]  # format tokens (<|channel|>, ...) are in neither list


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_each_effort_is_accepted(http, effort):
    out = chat(http, response_format=ANSWER, reasoning_effort=effort)
    assert json.loads(out["choices"][0]["message"]["content"])


def test_effort_none_is_the_default_medium_not_reasoning_off(http):
    none = chat(http, response_format=ANSWER, reasoning_effort="none")
    medium = chat(http, response_format=ANSWER, reasoning_effort="medium")
    assert (
        none["choices"] == medium["choices"]
    )  # the same prompt ('Reasoning: medium'), the same seeded sample
    assert none["choices"][0]["message"]["reasoning"]
    assert none["usage"]["prompt_tokens"] == medium["usage"]["prompt_tokens"]


@pytest.mark.parametrize("effort", ["low", "high"])
def test_tokenize_counts_the_prompt_as_chat_renders_it(http, effort):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "reasoning_effort": effort}
    counted = http.post("/v1/tokenize", json=body).json()
    out = chat(http, tools=[WEATHER], tool_choice="required", reasoning_effort=effort)
    assert counted["count"] == out["usage"]["prompt_tokens"]
    text = http.post("/v1/detokenize", json={"model": MODEL, "tokens": counted["tokens"]}).json()["prompt"]
    assert f"\nReasoning: {effort}\n" in text and text.endswith("<|start|>assistant")


# ---------------------------------------------------------------- the official SDKs


def test_cerebras_sdk_reasoning_and_tool_call(harmony_server):
    with cerebras_for(harmony_server.url) as client:
        body = request(tools=[WEATHER], tool_choice="required")
        out = client.chat.completions.create(**body)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.reasoning and message.tool_calls[0].function.name == "get_weather"
    assert_call(message.tool_calls[0].model_dump(), [WEATHER])
    assert out.usage.completion_tokens_details.reasoning_tokens > 0


def test_openai_sdk_streamed_structured_output(harmony_server):
    with openai_for(harmony_server.url) as client:
        stream = client.chat.completions.create(**request(response_format=ANSWER), stream=True)
        content, reasoning = [], []
        for chunk in stream:
            delta = chunk.choices[0].delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning") or "")
    assert json.loads("".join(content))["city"] in ("Paris", "Lyon")
    assert "".join(reasoning)
