"""Tools and structured outputs on /v1/chat/completions, through a real server and the official SDKs: every
tool_choice mode, arguments that validate against their schema whatever the model's size, streamed calls, tool
history, and response formats."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import MODEL
from test_chat import chat, chat_error, chat_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
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
        "description": "Current local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },  # not strict: constrained all the same (maxLength included)
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def assert_valid_calls(calls: list[dict]) -> None:
    for call in calls:
        assert call["type"] == "function" and len(call["id"]) == 9 and int(call["id"], 16) >= 0
        arguments = json.loads(call["function"]["arguments"])  # a JSON string, never an object
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])


def test_required_makes_a_valid_call(http):
    body = chat(
        http,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
    assert_valid_calls(choice["message"]["tool_calls"])


def test_named_choice_calls_exactly_that_function(http):
    body = chat(
        http,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert_valid_calls(calls)


def test_parallel_false_allows_one_call(http):
    body = chat(
        http,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0.8,
        seed=3,
    )
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_none_answers_in_text(http):
    body = chat(http, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    message = body["choices"][0]["message"]
    assert "tool_calls" not in message and "<tool_call>" not in message["content"]


def test_auto_answers_with_text_or_valid_calls(http):
    for seed in range(3):
        body = chat(http, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=1.0, seed=seed)
        choice = body["choices"][0]
        if choice["message"].get("tool_calls"):
            assert choice["finish_reason"] == "tool_calls"
            assert_valid_calls(choice["message"]["tool_calls"])
        else:
            assert "<tool_call>" not in choice["message"]["content"] or choice["finish_reason"] == "length"


def test_tools_count_in_prompt_tokens(http):
    plain = chat(http, messages=ASK, max_tokens=1)["usage"]["prompt_tokens"]
    with_tools = chat(http, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)["usage"]
    assert with_tools["prompt_tokens"] > plain + 50


def test_streamed_call_arrives_whole_in_one_chunk(http):
    chunks = chat_events(
        http,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )[:-1]
    with_calls = [c for c in chunks if c["choices"][0].get("delta", {}).get("tool_calls")]
    assert len(with_calls) == 1
    calls = with_calls[0]["choices"][0]["delta"]["tool_calls"]
    assert [c["index"] for c in calls] == [0]
    assert_valid_calls(calls)
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "tool_calls" and "usage" in last


def test_cerebras_sdk_tool_call(cerebras):
    completion = cerebras.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=80,
        temperature=0,
    )
    call = completion.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_history_with_a_call_and_its_result(http):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "27781e665",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "27781e665", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    body = chat(http, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    assert body["choices"][0]["message"]["content"]
    plain = chat(http, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert (
        body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    )  # the call and result were rendered


def test_unanswered_tool_call_is_400(http):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "abc", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "user", "content": "Well?"},
    ]
    chat_error(http, 400, messages=messages, tools=[WEATHER])


def test_tool_choice_needs_tools(http):
    err = chat_error(http, 400, tool_choice="required")
    assert "tools" in err["message"]


def test_named_choice_must_be_declared(http):
    chat_error(http, 400, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


# ---------------------------------------------------------------- response formats


def test_json_object_output_parses(http):
    body = chat(
        http,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].lstrip().startswith("{")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"anyOf": [{"type": "string", "enum": ["admin", "user"]}, {"type": "null"}]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def test_strict_json_schema_output_validates(http):
    body = chat(
        http,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON},
        },
        max_tokens=80,
        temperature=0,
    )
    assert body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


def test_openai_sdk_structured_output(openai_client):
    completion = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON},
        },
        max_tokens=80,
        temperature=0,
    )
    jsonschema.validate(json.loads(completion.choices[0].message.content), PERSON)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({**PERSON, "definitions": {"x": {"type": "string"}}}, "definitions"),
        ({**PERSON, "properties": {**PERSON["properties"], "age": {"type": ["integer", "null"]}}}, "type"),
        ({**PERSON, "required": ["name", "age"]}, "required"),
        ({k: v for k, v in PERSON.items() if k != "additionalProperties"}, "additionalProperties"),
    ],
    ids=["definitions", "type-list", "not-all-required", "open-object"],
)
def test_unsupported_strict_schema_is_400_naming_the_keyword(http, schema, keyword):
    err = chat_error(
        http,
        400,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "strict": True, "schema": schema},
        },
    )
    assert keyword in err["message"] and err["param"].startswith("response_format")


def test_json_schema_needs_a_name(http):
    err = chat_error(http, 400, response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    assert "name" in err["message"] and err["code"] == "wrong_api_format"


def test_raw_reasoning_with_json_is_accepted_for_a_model_without_reasoning(http):
    body = chat(http, response_format={"type": "json_object"}, reasoning_format="raw", max_tokens=4)
    message = body["choices"][0]["message"]
    assert "reasoning" not in message and message["content"].strip()[:1] in ("", "{")
