"""HTTP contract: response fields, streaming framing, validation, errors, models, health, auth."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import ALIAS, MODEL, Server, complete, sse_events

PROMPT = "It was a dark and stormy night"
OPTIONAL_FIELDS = [
    "best_of",
    "echo",
    "frequency_penalty",
    "grammar_root",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "min_tokens",
    "n",
    "presence_penalty",
    "prompt_cache_key",
    "reasoning_format",
    "return_raw_tokens",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
]


def test_response_carries_every_field(http):
    out = complete(http, model=ALIAS, prompt=PROMPT, max_tokens=3)
    assert out["id"].startswith("cmpl-")
    assert out["object"] == "text_completion"
    assert isinstance(out["created"], int)
    assert out["model"] == ALIAS  # the name the request used
    assert out["system_fingerprint"].startswith("fp_")
    assert set(out["usage"]) >= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert set(out["time_info"]) == {"queue_time", "prompt_time", "completion_time", "total_time", "created"}


def test_system_fingerprint_is_stable(http):
    a = complete(http, prompt="a", max_tokens=1)["system_fingerprint"]
    b = complete(http, prompt="b", max_tokens=1)["system_fingerprint"]
    assert a == b


def test_null_is_accepted_for_every_optional_field(http):
    body = {"model": MODEL, "prompt": PROMPT, **{f: None for f in OPTIONAL_FIELDS}, "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "value", "loc"),
    [
        ("temperature", 2.5, ["body", "temperature"]),
        ("top_p", 1.5, ["body", "top_p"]),
        ("logprobs", 21, ["body", "logprobs"]),
        ("n", 0, ["body", "n"]),
        ("max_tokens", -2, ["body", "max_tokens"]),
        ("stop", ["a", "b", "c", "d", "e"], ["body", "stop", "list[str]"]),
        ("frequency_penalty", 3, ["body", "frequency_penalty"]),
        ("unknown_field", 1, ["body", "unknown_field"]),
    ],
)
def test_invalid_fields_get_422_with_location(http, field, value, loc):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, field: value})
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert any(d["loc"][: len(loc)] == loc for d in detail), detail
    assert all(set(d) == {"loc", "msg", "type"} for d in detail)


def test_missing_required_fields_get_422(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model"]


def test_unknown_model_is_404_naming_served_models(http):
    r = http.post("/v1/completions", json={"model": "gpt-9", "prompt": PROMPT})
    assert r.status_code == 404
    err = r.json()
    assert err["status_code"] == 404 and MODEL in err["error"]["message"] and ALIAS in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code", "id"}


def test_context_overflow_is_400_naming_the_numbers(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8190})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "7" in msg and "8190" in msg and "8192" in msg


def test_out_of_vocabulary_token_id_is_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 49152]})
    assert r.status_code == 400 and "49152" in r.json()["error"]["message"]


def test_bad_requests_leave_the_server_serving(http):
    for body in (b"{", b"[]", b'{"model": 1}'):
        assert (
            http.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            ).status_code
            < 500
        )
    assert complete(http, prompt=PROMPT, max_tokens=2)["choices"][0]["text"]


@pytest.mark.parametrize("include_usage", [True, False, None])
def test_stream_ends_with_usage_and_time_info_on_the_finish_chunk(http, include_usage):
    """As the hosted service streams: the chunk with the last finish_reason carries usage and time_info, whether
    or not include_usage is set, and no chunk has empty choices."""
    options = {} if include_usage is None else {"stream_options": {"include_usage": include_usage}}
    events = sse_events(http, prompt=PROMPT, max_tokens=5, temperature=0, **options)  # greedy: never an early EOS
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 5 and last["time_info"]["total_time"] > 0
    assert all("usage" not in c and "time_info" not in c for c in chunks[:-1])


def test_stream_chunks_share_id_and_created(http):
    chunks = sse_events(http, prompt=PROMPT, max_tokens=6)[:-1]
    assert len({(c["id"], c["created"], c["model"], c["system_fingerprint"]) for c in chunks}) == 1


def test_models_endpoints(http):
    listed = http.get("/v1/models").json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == [MODEL, ALIAS]
    assert http.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["status_code"] == 404


def test_health_and_tcp_warming(http):
    assert http.get("/health").status_code == 200
    assert http.get("/v1/tcp_warming").status_code == 200


def test_open_server_says_so_at_start(server):
    assert "no API key set" in server.log()


@pytest.fixture(scope="module")
def keyed_server():
    s = Server("--api-key", "alpha-k3y,beta-k3y", "--log-requests", env={"WAFERSCALE_API_KEY": "gamma-k3y"})
    yield s
    s.stop()


def test_api_keys_are_required_when_set(keyed_server):
    from cerebras.cloud.sdk import AuthenticationError, Cerebras

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=keyed_server.url) as http:
        assert http.post("/v1/completions", json=body).status_code == 401
        bad = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer delta-k3y"})
        assert bad.status_code == 401 and bad.json()["status_code"] == 401
        assert "alpha-k3y" not in bad.text
        for key in ("alpha-k3y", "beta-k3y", "gamma-k3y"):
            ok = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer gamma-k3y"}).status_code == 200
        assert http.get("/health").status_code == 200
    client = Cerebras(api_key="wrong", base_url=keyed_server.url, max_retries=0)
    with pytest.raises(AuthenticationError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    good = Cerebras(api_key="beta-k3y", base_url=keyed_server.url, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
    assert "no API key set" not in keyed_server.log()


def test_401_is_the_same_whatever_key_was_sent_and_keys_are_never_logged(keyed_server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    answers = set()
    with httpx.Client(base_url=keyed_server.url) as http:
        for header in (None, "Bearer alph", "Bearer alpha2", "Bearer", "Basic alpha-k3y", "alpha-k3y"):
            r = http.post("/v1/completions", json=body, headers={"Authorization": header} if header else {})
            assert r.status_code == 401
            answers.add(r.text)
        http.post("/v1/completions", json=body, headers={"Authorization": "Bearer alpha-k3y"})
    assert len(answers) == 1
    log = keyed_server.log()
    assert not any(k in log for k in ("alpha-k3y", "beta-k3y", "gamma-k3y"))


def test_prompts_and_outputs_are_logged_only_with_log_requests(http, server, keyed_server):
    body = {"model": MODEL, "prompt": "The zebra-striped quokka", "max_tokens": 3}
    out = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "quokka" not in server.log() and (not out.strip() or out not in server.log())
    with httpx.Client(base_url=keyed_server.url) as keyed:
        r = keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer beta-k3y"})
    assert r.status_code == 200 and "zebra-striped quokka" in keyed_server.log()


def test_server_says_where_it_listens(server):
    assert "this machine only" in server.log() and "127.0.0.1" in server.log()


def test_oversized_headers_are_refused_and_the_server_goes_on(http, server):
    host, port = server.url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n")
            answer = sock.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered 400 and closed while we were still sending
        if not answer:
            try:
                answer = sock.recv(4096)
            except OSError:  # reset after its 400 went unread: refused all the same
                answer = b"reset"
    assert answer.startswith(b"HTTP/1.1 400") or answer == b"reset", answer[:100]
    assert http.get("/health").status_code == 200


def test_client_disconnect_mid_stream_leaves_server_healthy(http, server):
    with httpx.Client(base_url=server.url, timeout=60) as other:
        with other.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    # the aborted sequence must not hold the engine: a new request completes promptly
    out = complete(http, prompt=PROMPT, max_tokens=3)
    assert out["time_info"]["queue_time"] < 1.0


def test_tokenize_counts_a_prompt_as_completions_count_it(http):
    prompt = "Numbers 12345 and   spaces\n\ttabs, émigré"
    out = http.post("/v1/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    done = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()
    assert out["count"] == len(out["tokens"]) == done["usage"]["prompt_tokens"]
    assert out["max_model_len"] == 8192


def test_tokenize_renders_messages_through_the_chat_template(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages, "return_token_strs": True}).json()
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert out["count"] == chat["usage"]["prompt_tokens"]
    assert out["token_strs"][:2] == ["<|im_start|>", "system"]
    without = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert without.json()["count"] < out["count"]


def test_detokenize_round_trips_tokenize(http):
    prompt = "A round trip: 😀 and <|im_end|>"
    ids = http.post("/v1/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert http.post("/v1/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": prompt}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/tokenize", {"model": MODEL}, "prompt"),
        ("/v1/tokenize", {"model": MODEL, "prompt": "a", "messages": []}, "prompt"),
        ("/v1/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
        ("/v1/detokenize", {"model": MODEL, "tokens": [-1]}, "validation_error"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_input_with_a_400(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenize_names_the_served_models_for_an_unknown_one(http):
    r = http.post("/v1/tokenize", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"]
