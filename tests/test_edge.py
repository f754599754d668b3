"""The HTTP edge on a running server: bodies read as a stream under the cap whatever the framing, Accept
negotiated with q-values, inert contract headers accepted and logged, integer logit_bias keys from msgpack, and
prompts that cannot fit refused with the hosted words."""

from __future__ import annotations

import json
import select
import socket
import time

import msgpack
import pytest
from conftest import MODEL

MiB = 1 << 20
CAP = 32 * MiB
BODY = {"model": MODEL, "prompt": "It was a dark and stormy night", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_chunked_body_over_the_cap_is_refused_as_it_crosses_without_buffering_it(server, path):
    """Chunked framing declares no length: the server must count as it reads, answer 413 once the count passes
    32 MiB, and never hold the rest (the client offers 256 MiB)."""
    base = peak = rss(server.proc.pid)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b"%x\r\n" % MiB + b" " * MiB + b"\r\n"
    sent = 0
    try:
        while sent < 256 * MiB:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered
            sock.sendall(chunk)
            sent += MiB
            peak = max(peak, rss(server.proc.pid))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed the connection
    head = b""
    deadline = time.time() + 30
    while b"\r\n\r\n" not in head and time.time() < deadline:
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        head += data
    sock.close()
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent <= CAP + 16 * MiB, f"the server read {sent >> 20} MiB before answering"
    assert peak - base < 128 * MiB, f"server RSS grew by {(peak - base) >> 20} MiB"


def test_a_declared_length_over_the_cap_is_refused(http):
    r = http.post(
        "/v1/completions",
        content=b" " * (CAP + 1),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["status_code"] == 413


@pytest.mark.parametrize(
    ("accept", "packed"),
    [
        ("application/json, application/msgpack;q=0.1", False),
        ("application/msgpack", True),
        ("*/*", False),
        ("application/msgpack, application/json;q=0", True),
        ("application/json;q=0.5, application/x-msgpack", True),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_accept_is_negotiated_with_q_values(http, path, accept, packed):
    body = BODY if path == "/v1/completions" else CHAT
    r = http.post(path, json=body, headers={"accept": accept})
    assert r.status_code == 200, r.text
    if packed:
        assert r.headers["content-type"] == "application/msgpack"
        assert msgpack.unpackb(r.content)["choices"]
    else:
        assert r.headers["content-type"] == "application/json"
        assert r.json()["choices"]


def test_inert_contract_headers_are_accepted_whatever_their_value_and_logged(http, server):
    r = http.post("/v1/completions", json=BODY, headers={"X-delay-time": "abc"})
    assert r.status_code == 200, r.text
    r = http.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"X-delay-time": "-1e999", "queue_threshold": "soon", "X-Cerebras-Version-Patch": "latest"},
    )
    assert r.status_code == 200, r.text
    log = server.log()
    assert "completion request inert headers x-delay-time='abc'" in log
    assert "queue_threshold='soon'" in log and "x-cerebras-version-patch='latest'" in log


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_integer_logit_bias_keys_from_msgpack(http, path):
    body = {**(BODY if path == "/v1/completions" else CHAT), "max_tokens": 3, "logit_bias": {1234: 100}}
    r = http.post(path, content=msgpack.packb(body), headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    usage_ids = r.json()
    text = usage_ids["choices"][0].get("text") or usage_ids["choices"][0]["message"]["content"]
    assert text  # token 1234 forced every step
    body["logit_bias"] = {10**7: 1}
    r = http.post(path, content=msgpack.packb(body), headers={"content-type": "application/msgpack"})
    assert r.status_code == 400
    err = r.json()
    assert (err.get("error") or err)["param"] == "logit_bias"


def test_a_prompt_that_cannot_fit_is_refused_fast_in_the_hosted_words(http):
    text = (
        "All work and no play makes Jack a dull boy. " * 200_000
    )  # 8.8 MB: a full tokenization takes seconds
    start = time.perf_counter()
    r = http.post("/v1/completions", json={**BODY, "prompt": text})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "8192" in err["message"]
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400
    err = r.json()
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith(
        "Please reduce the length of the messages or completion. Current length is "
    )
    assert err["message"].endswith("while limit is 8192")
    r = http.post("/v1/completions", content=json.dumps({**BODY, "prompt": [42] * 1_000_000}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    print(f"three over-long prompts refused in {time.perf_counter() - start:.1f} s")
