"""POST /v1/chat/completions through the official Cerebras SDK (strict response validation), the OpenAI SDK and plain
HTTP: the answer's shape, the template, the engine path it shares with /v1/completions, streaming in the hosted
service's order, logprobs in the chat shape, and errors in the chat contract's flat shape."""

from __future__ import annotations

import gzip
import json

import msgpack
import pytest
from conftest import ALIAS, MODEL, complete, sse_events

HELLO = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = [{"role": "system", "content": "You are a terse assistant."}, *HELLO]
STORY = [
    {"role": "user", "content": "Tell me a long story about a dragon."}
]  # runs past any small max_tokens


def chat(http, **body) -> dict:
    body.setdefault("model", MODEL)
    body.setdefault("messages", HELLO)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_error(http, status: int, **body) -> dict:
    body.setdefault("model", MODEL)
    body.setdefault("messages", HELLO)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"message", "type", "param", "code"}, err  # flat, as the hosted service answers
    return err


def chat_events(http, **body) -> list:
    body.setdefault("messages", HELLO)
    return sse_events(http, "/v1/chat/completions", **body)


def rendered(hf_tokenizer, messages, **kwargs) -> list[int]:
    """The reference: transformers' own rendering of the conversation, as token ids."""
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding


# ---------------------------------------------------------------- the answer


def test_cerebras_sdk_chat_parses_with_strict_validation(cerebras):
    completion = cerebras.chat.completions.create(model=ALIAS, messages=SYSTEM, max_completion_tokens=12)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and completion.model == ALIAS
    assert completion.system_fingerprint
    choice = completion.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert (
        completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0
    assert completion.time_info.total_time > 0 and completion.time_info.created > 0


def test_openai_sdk_chat(openai_client):
    completion = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant" and completion.choices[0].message.content
    assert completion.usage.completion_tokens <= 8


def test_prompt_tokens_count_the_rendered_template(http, hf_tokenizer):
    body = chat(http, messages=SYSTEM, max_completion_tokens=1)
    assert body["usage"]["prompt_tokens"] == len(rendered(hf_tokenizer, SYSTEM))


def test_greedy_chat_equals_a_completion_of_the_rendered_prompt(http_f32, hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(SYSTEM, add_generation_prompt=True, tokenize=False)
    expected = complete(http_f32, prompt=text, max_tokens=24, temperature=0)["choices"][0]["text"]
    body = chat(http_f32, messages=SYSTEM, max_completion_tokens=24, temperature=0)
    assert body["choices"][0]["message"]["content"] == expected


def test_max_completion_tokens_wins_over_max_tokens(http):
    body = chat(http, max_completion_tokens=3, max_tokens=9, temperature=0, min_completion_tokens=3)
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"


def test_developer_renders_as_system(http_f32):
    as_developer = chat(
        http_f32, messages=[{"role": "developer", "content": "Be terse."}, *HELLO], max_tokens=8, temperature=0
    )
    as_system = chat(
        http_f32, messages=[{"role": "system", "content": "Be terse."}, *HELLO], max_tokens=8, temperature=0
    )
    n = as_system["usage"]["prompt_tokens"]
    assert as_developer["usage"]["prompt_tokens"] == n
    # the same tokens: every whole 16-token block of the second found in the cache the first left
    assert as_system["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    assert as_developer["choices"][0]["message"] == as_system["choices"][0]["message"]


def test_text_parts_are_joined(http_f32):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    a = chat(http_f32, messages=parts, max_tokens=6, temperature=0)
    b = chat(http_f32, messages=joined, max_tokens=6, temperature=0)
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_n_choices(http):
    body = chat(http, n=3, max_tokens=4, temperature=1.0, seed=7)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert 3 <= body["usage"]["completion_tokens"] <= 12


def test_seeded_sampling_repeats(http):
    a = chat(http, max_tokens=12, temperature=1.0, seed=123)["choices"][0]["message"]["content"]
    b = chat(http, max_tokens=12, temperature=1.0, seed=123)["choices"][0]["message"]["content"]
    assert a == b


def test_stop_sequence_ends_the_message_without_it(http):
    full = chat(http, max_tokens=24, temperature=0)["choices"][0]["message"]["content"]
    word = full.split()[1]
    body = chat(http, max_tokens=24, temperature=0, stop=[word])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert word not in body["choices"][0]["message"]["content"]


def test_multi_turn_reuses_the_previous_turn_from_the_prefix_cache(http):
    history = [{"role": "system", "content": "You answer in one short sentence. " * 8}, *HELLO]
    first = chat(http, messages=history, max_tokens=16, temperature=0)
    turn = [*history, first["choices"][0]["message"], {"role": "user", "content": "And of Spain?"}]
    second = chat(http, messages=turn, max_tokens=4, temperature=0)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] <= second["usage"]["prompt_tokens"]


def test_accepted_inert_fields(http):
    body = chat(
        http,
        max_tokens=2,
        user="u-1",
        prompt_cache_key="conv-1",
        service_tier="auto",
        reasoning_effort="low",
        reasoning_format="parsed",
        disable_reasoning=False,
        clear_thinking=True,
        model_parameters={},
        stream_options=None,
        parallel_tool_calls=True,
    )
    assert body["service_tier_used"] == "default"
    assert "reasoning" not in body["choices"][0]["message"]  # this model does not reason


def test_msgpack_and_gzip_bodies(http_f32):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0}
    expected = chat(http_f32, **body)["choices"][0]["message"]["content"]
    for content, headers in (
        (msgpack.packb(body), {"content-type": "application/vnd.msgpack"}),
        (
            gzip.compress(json.dumps(body).encode()),
            {"content-type": "application/json", "content-encoding": "gzip"},
        ),
    ):
        r = http_f32.post("/v1/chat/completions", content=content, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected


# ---------------------------------------------------------------- logprobs


def test_logprobs_in_the_chat_shape(http):
    body = chat(http, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] or "\ufffd" in e["token"]
        tops = e["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted(
            (t["logprob"] for t in tops), reverse=True
        )
        assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == pytest.approx(e["logprob"], abs=1e-5)


def test_logprobs_without_alternatives(http):
    body = chat(http, max_tokens=3, logprobs=True)
    assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])


# ---------------------------------------------------------------- streaming


def test_stream_in_the_hosted_order(http):
    events = chat_events(http, messages=STORY, max_tokens=5, temperature=0)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}}]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert len({(c["id"], c["created"], c["model"], c["system_fingerprint"]) for c in chunks}) == 1
    last = chunks[-1]
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 5 and last["time_info"]["total_time"] > 0
    middle = chunks[1:-1]
    assert middle and all(set(c["choices"][0]) == {"index", "delta"} for c in middle)  # nulls omitted
    assert all("usage" not in c and "time_info" not in c for c in chunks[:-1])


def test_stream_content_equals_the_whole_answer(cerebras_f32):
    cerebras = cerebras_f32
    full = cerebras.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    chunks = list(
        cerebras.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_sdk_stream_with_logprobs(openai_client):
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, stream=True, logprobs=True, top_logprobs=2
    )
    chunks = list(stream)
    tokens = [
        e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert "".join(tokens) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_stream_with_n_finishes_every_choice(http):
    chunks = chat_events(http, max_tokens=4, n=2, temperature=1.0, seed=1)[:-1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0].get("finish_reason")]
    assert sorted(finished) == [0, 1]
    assert "usage" in chunks[-1] and sum("usage" in c for c in chunks) == 1


def test_stream_error_after_start_is_an_error_chunk(http):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 20, "stream": True}
    with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-waferscale-fault-after": "3"}
    ) as r:
        assert r.status_code == 200
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert data[-1]["status_code"] == 500 and data[-1]["error"]["message"]


# ---------------------------------------------------------------- errors


def test_unknown_field_is_400_wrong_api_format(http):
    err = chat_error(http, 400, temperature_typo=0.5)
    assert err["code"] == "wrong_api_format" and err["type"] == "invalid_request_error"
    assert "temperature_typo" in err["message"] and "unsupported" in err["message"]


def test_reasoning_content_in_a_message_is_rejected(http):
    messages = [*HELLO, {"role": "assistant", "content": "Paris.", "reasoning_content": "easy"}]
    err = chat_error(http, 400, messages=messages)
    assert "messages.1.assistant.reasoning_content" in err["message"]


def test_missing_role_is_400(http):
    err = chat_error(http, 400, messages=[{"content": "hi"}])
    assert "role" in err["message"]


def test_unknown_model_is_404_in_the_hosted_words(cerebras):
    from cerebras.cloud.sdk import NotFoundError

    with pytest.raises(NotFoundError) as info:
        cerebras.chat.completions.create(model="no-such-model", messages=HELLO)
    body = info.value.body
    assert (
        body["type"] == "not_found_error" and body["code"] == "model_not_found" and body["param"] == "model"
    )


def test_image_part_is_400_for_a_text_model(http):
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}
    ]
    err = chat_error(http, 400, messages=messages)
    assert "text only" in err["message"]


def test_top_logprobs_needs_logprobs(http):
    err = chat_error(http, 400, top_logprobs=2)
    assert err["param"] == "top_logprobs"


def test_context_overflow_in_the_hosted_words(http):
    err = chat_error(http, 400, max_completion_tokens=9000)
    assert err["message"].startswith(
        "Please reduce the length of the messages or completion. Current length is "
    )
    assert "limit is 8192" in err["message"]


def test_model_parameters_are_refused_for_this_model(http):
    err = chat_error(http, 400, model_parameters={"top_k": 5})
    assert err["param"] == "model_parameters" and "top_k" in err["message"]


def test_empty_messages_is_400(http):
    chat_error(http, 400, messages=[])


def test_errors_leave_the_server_serving(http):
    for body in (
        {"model": MODEL},
        {"model": MODEL, "messages": "hi"},
        {"model": MODEL, "messages": [{"role": "x"}]},
    ):
        assert http.post("/v1/chat/completions", json=body).status_code == 400
    assert chat(http, max_tokens=2)["choices"][0]["message"]["content"] is not None


# ---------------------------------------------------------------- predicted outputs


def test_a_right_prediction_is_accepted_and_changes_nothing(http_f32):
    """float32: greedy answers do not depend on how many tokens a step verifies."""
    base = {"model": MODEL, "messages": STORY, "max_tokens": 40, "temperature": 0}
    plain = chat(http_f32, **base)
    text = plain["choices"][0]["message"]["content"]
    predicted = chat(http_f32, **base, prediction={"type": "content", "content": text})
    assert predicted["choices"][0]["message"]["content"] == text
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 30
    assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


def test_a_wrong_prediction_changes_nothing(http_f32):
    base = {"model": MODEL, "messages": STORY, "max_tokens": 24, "temperature": 0}
    text = chat(http_f32, **base)["choices"][0]["message"]["content"]
    parts = [
        {"type": "text", "text": "A completely different"},
        {"type": "text", "text": "story about robots."},
    ]
    wrong = chat(http_f32, **base, prediction={"type": "content", "content": parts})
    assert wrong["choices"][0]["message"]["content"] == text
