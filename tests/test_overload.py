"""Overload: a bounded waiting queue (429 + Retry-After beyond it) and a queue timeout (503, never a hang)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import MODEL, Server


@pytest.fixture(scope="module")
def busy_server():
    """One sequence at a time, one may wait, and none may wait longer than 8 s."""
    s = Server("--max-num-seqs", "1", "--max-waiting", "1", "--queue-timeout", "8")
    yield s
    s.stop()


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for(predicate, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


class Running:
    """A streamed request that holds the only batch slot until closed."""

    def __init__(self, server, tokens: int):
        self.client = httpx.Client(base_url=server.url, timeout=120)
        body = {
            "model": MODEL,
            "prompt": "Count:",
            "max_tokens": tokens,
            "min_tokens": tokens,
            "stream": True,
        }
        self.cm = self.client.stream("POST", "/v1/completions", json=body)
        self.response = self.cm.__enter__()
        self.lines = self.response.iter_lines()  # kept: a collected iterator would close the stream
        next(self.lines)  # its first chunk: it is running

    def close(self):
        self.cm.__exit__(None, None, None)
        self.client.close()


def in_thread(fn) -> dict:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    out["thread"] = t
    return out


def test_beyond_the_waiting_queue_a_request_gets_429_with_retry_after(busy_server):
    running = Running(busy_server, 2000)
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        waiter = in_thread(lambda: httpx.post(busy_server.url + "/v1/completions", json=body, timeout=120))
        wait_for(lambda: metric(busy_server, "waferscale_waiting") == 1)
        r = httpx.post(busy_server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        assert r.json()["status_code"] == 429 and "capacity" in r.json()["error"]["message"]
    finally:
        running.close()
    waiter["thread"].join(60)
    assert waiter["r"].status_code == 200  # the waiting one is served once the slot frees


def test_a_request_waiting_past_the_queue_timeout_gets_503(busy_server):
    running = Running(busy_server, 2000)
    try:
        started = time.time()
        r = httpx.post(
            busy_server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 503 and "queue timeout" in r.json()["error"]["message"]
        assert 8 <= time.time() - started < 20
    finally:
        running.close()
    assert metric(busy_server, "waferscale_queue_timeouts_total") >= 1


def test_the_sdk_retries_succeed_once_load_drops(busy_server):
    from cerebras.cloud.sdk import Cerebras

    before = metric(busy_server, "waferscale_rejected_requests_total")
    running = Running(busy_server, 40)  # about two seconds of work
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    waiter = in_thread(lambda: httpx.post(busy_server.url + "/v1/completions", json=body, timeout=120))
    wait_for(lambda: metric(busy_server, "waferscale_waiting") == 1)
    with Cerebras(api_key="unused", base_url=busy_server.url, max_retries=8) as client:
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert out.choices[0].text is not None
    assert metric(busy_server, "waferscale_rejected_requests_total") > before  # it was turned away first
    running.close()
    waiter["thread"].join(60)
    assert waiter["r"].status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_finishes_short_requests_and_ends_long_ones_with_an_error(sig):
    server = Server("--shutdown-grace", "3")
    try:
        long_stream = Running(server, 4000)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "min_tokens": 4000}
        long_plain = in_thread(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60))
        wait_for(lambda: metric(server, "waferscale_running") == 2)
        short = Running(server, 16)  # streamed, so that it is surely running (not yet finished) at the signal
        server.proc.send_signal(sig)
        lines = list(long_stream.lines)
        short_lines = [line for line in short.lines if line]
        long_plain["thread"].join(30)
        assert short_lines[-1] == "data: [DONE]" and not any('"error"' in line for line in short_lines)
        assert (
            long_plain["r"].status_code == 503
            and "shutting down" in long_plain["r"].json()["error"]["message"]
        )
        errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
        assert errors and errors[-1]["status_code"] == 503
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert server.proc.wait(timeout=30) in (0, -sig)  # uvicorn re-raises the signal once drained
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health")
    finally:
        server.stop()
