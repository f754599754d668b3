"""Per-key limits on a real server over loopback: a key file with five keys, their x-ratelimit-* headers on every
kind of response, 429s before anything is queued, usage in /metrics and `waferscale usage`, SIGHUP reload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import MODEL, ROOT, Server

KEYS = """
[keys.alice]
key = "sk-alice"
requests_per_day = 1000
tokens_per_minute = 20000

[keys.bob]
key = "sk-bob"
requests_per_day = 500
tokens_per_minute = 50000
tokens_per_day = 1000000

[keys.carol]          # one request a minute
key = "sk-carol"
requests_per_minute = 1

[keys.dave]           # too few tokens for a long answer
key = "sk-dave"
tokens_per_minute = 100

[keys.eve]            # no limits
key = "sk-eve"
"""
HOSTED = [
    "x-ratelimit-limit-requests-day",
    "x-ratelimit-limit-tokens-minute",
    "x-ratelimit-remaining-requests-day",
    "x-ratelimit-remaining-tokens-minute",
    "x-ratelimit-reset-requests-day",
    "x-ratelimit-reset-tokens-minute",
]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def quota_server(keys_file):
    s = Server("--api-keys-file", str(keys_file), "--served-model-name", "llama3.1-8b")
    yield s
    s.stop()


def client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_completion_tokens": 4, **extra}


def completion_body(**extra) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **extra}


def metric(server: Server, name: str, key: str = "sk-eve") -> float:
    text = client(server, key).get("/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_two_keys_show_their_own_limits_and_remaining_counts(quota_server):
    a = client(quota_server, "sk-alice").post("/v1/chat/completions", json=chat_body())
    b = client(quota_server, "sk-bob").post("/v1/chat/completions", json=chat_body())
    assert a.status_code == b.status_code == 200
    assert (a.headers["x-ratelimit-limit-requests-day"], a.headers["x-ratelimit-limit-tokens-minute"]) == (
        "1000",
        "20000",
    )
    assert (b.headers["x-ratelimit-limit-requests-day"], b.headers["x-ratelimit-limit-tokens-minute"]) == (
        "500",
        "50000",
    )
    assert int(a.headers["x-ratelimit-remaining-requests-day"]) < 1000
    assert int(b.headers["x-ratelimit-remaining-requests-day"]) < 500
    assert int(b.headers["x-ratelimit-remaining-tokens-minute"]) > 20000  # bob's bucket, not alice's


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_answer_carries_the_hosted_headers(quota_server, path, stream):
    body = chat_body(stream=stream) if path.endswith("chat/completions") else completion_body(stream=stream)
    with client(quota_server, "sk-alice").stream("POST", path, json=body) as r:
        r.read()
    assert r.status_code == 200
    assert all(h in r.headers for h in HOSTED)
    assert float(r.headers["x-ratelimit-reset-tokens-minute"]) >= 0


def test_a_stream_shows_its_reservation_taken(quota_server):
    with client(quota_server, "sk-bob").stream(
        "POST", "/v1/completions", json=completion_body(stream=True, max_tokens=2000)
    ) as r:
        remaining = int(r.headers["x-ratelimit-remaining-tokens-day"])  # then hang up
    assert remaining <= 1_000_000 - 2000 + 1000  # less what a minute of refill (694) could have given back


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", completion_body(temperature=5), 422),
        ("/v1/completions", completion_body(model="no-such-model"), 404),
        ("/v1/chat/completions", chat_body(temperature=5), 400),
        ("/v1/chat/completions", chat_body(model="no-such-model"), 404),
        ("/v1/chat/completions", chat_body(max_completion_tokens=10**6), 400),
    ],
)
def test_errors_carry_the_headers_too(quota_server, path, body, status):
    r = client(quota_server, "sk-alice").post(path, json=body)
    assert r.status_code == status
    assert all(h in r.headers for h in HOSTED)


def test_over_the_request_limit_is_429_with_retry_after_and_nothing_queued(quota_server):
    carol = client(quota_server, "sk-carol")
    assert carol.post("/v1/completions", json=completion_body()).status_code == 200
    generated = metric(quota_server, "waferscale_generated_tokens_total")
    r = carol.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 429
    assert r.json() | {"message": ""} == {
        "message": "",
        "type": "too_many_requests_error",
        "param": "quota",
        "code": "request_quota_exceeded",
    }
    assert r.json()["message"].startswith("Requests per minute limit exceeded")
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests-minute"] == "0"
    assert metric(quota_server, "waferscale_generated_tokens_total") == generated
    assert metric(quota_server, 'waferscale_key_rate_limited_total{key="carol"}') == 1


def test_over_the_token_limit_is_429_in_the_completions_shape(quota_server):
    r = client(quota_server, "sk-dave").post("/v1/completions", json=completion_body(max_tokens=200))
    assert r.status_code == 429
    err = r.json()["error"]
    assert (r.json()["status_code"], err["type"], err["code"]) == (
        429,
        "too_many_requests_error",
        "token_quota_exceeded",
    )
    assert "max_tokens" in err["message"]  # alone it can never fit: the client is told what to change


def test_unset_max_tokens_reserves_the_context_left(quota_server):
    r = client(quota_server, "sk-dave").post("/v1/chat/completions", json=chat_body(max_completion_tokens=None))
    assert r.status_code == 429 and r.json()["code"] == "token_quota_exceeded"


def test_the_sdk_sees_the_headers_and_the_rate_limit_error(quota_server):
    from cerebras.cloud.sdk import Cerebras, RateLimitError

    sdk = Cerebras(api_key="sk-dave", base_url=quota_server.url, max_retries=0)
    raw = sdk.chat.completions.with_raw_response.create(**chat_body())
    assert raw.headers["x-ratelimit-limit-tokens-minute"] == "100"
    with pytest.raises(RateLimitError):
        sdk.chat.completions.create(**chat_body(max_completion_tokens=500))


def test_a_key_without_limits_sends_no_rate_limit_headers(quota_server):
    r = client(quota_server, "sk-eve").post("/v1/completions", json=completion_body())
    assert r.status_code == 200
    assert not [h for h in r.headers if h.startswith("x-ratelimit-")]


def test_a_wrong_key_gets_401_without_headers(quota_server):
    r = client(quota_server, "sk-mallory").post("/v1/completions", json=completion_body())
    assert r.status_code == 401
    assert not [h for h in r.headers if h.startswith("x-ratelimit-")]


def test_usage_is_counted_by_key_name_and_never_shows_a_key(quota_server):
    eve = client(quota_server, "sk-eve")
    before = metric(quota_server, 'waferscale_key_requests_total{key="eve"}')
    r = eve.post("/v1/completions", json=completion_body())
    usage = r.json()["usage"]
    text = eve.get("/metrics").text
    assert f'waferscale_key_requests_total{{key="eve"}} {before + 1}' in text
    assert 'waferscale_key_completion_tokens_total{key="eve"}' in text
    assert usage["completion_tokens"] > 0
    assert "sk-" not in text and "sk-" not in quota_server.log()


def test_the_usage_command_prints_a_line_per_key(quota_server):
    out = subprocess.run(
        [sys.executable, "-m", "waferscale", "usage", "--url", quota_server.url, "--api-key", "sk-eve"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["key", "requests", "429s", "prompt", "cached", "completion"]
    assert {line.split()[0] for line in lines[1:]} >= {"alice", "bob", "carol", "eve", "total"}


def test_sighup_reloads_the_keys_without_losing_a_request(quota_server, keys_file):
    bob = client(quota_server, "sk-bob")

    def ask(i: int) -> int:
        return bob.post("/v1/completions", json=completion_body(prompt=f"Story {i}:", max_tokens=8)).status_code

    try:
        with ThreadPoolExecutor(12) as pool:
            answers = [pool.submit(ask, i) for i in range(24)]
            deadline = time.monotonic() + 120
            while metric(quota_server, "waferscale_running ") < 1 and time.monotonic() < deadline:
                pass  # until requests are in flight
            keys_file.write_text(KEYS + '\n[keys.frank]\nkey = "sk-frank"\nrequests_per_day = 7\n')
            quota_server.proc.send_signal(signal.SIGHUP)
            codes = [a.result() for a in answers]
        assert codes == [200] * 24
        r = client(quota_server, "sk-frank").post("/v1/completions", json=completion_body())
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests-day"] == "7"
        assert "reloaded" in quota_server.log() and "sk-frank" not in quota_server.log()
    finally:
        keys_file.write_text(KEYS)
        quota_server.proc.send_signal(signal.SIGHUP)
