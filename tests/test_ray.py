"""Engine replicas on Ray Serve through a real client: float32 greedy answers equal the single process's, prompts
sharing a prefix (or a prompt_cache_key) land where their blocks are cached, /metrics labels each replica, and a
replica killed mid-request ends its requests with clear 503s while the survivor serves and Serve replaces it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import MODEL, complete

pytestmark = pytest.mark.ray
PROMPTS = ["It was a dark and stormy night", "The three laws of robotics are", "def fibonacci(n):"]


@pytest.fixture
def ray_http(ray_server):
    with httpx.Client(base_url=ray_server.url, timeout=120) as client:
        yield client


def test_greedy_float32_answers_equal_the_single_process(ray_http, http_f32):
    for prompt in PROMPTS:
        body = dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
        ours, theirs = complete(ray_http, **body)["choices"][0], complete(http_f32, **body)["choices"][0]
        assert ours["text"] == theirs["text"]
        assert ours["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert ours["logprobs"]["token_logprobs"] == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-5)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=16, temperature=0)
    a = ray_http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    b = http_f32.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    assert a == b


def test_a_shared_prefix_or_cache_key_finds_its_cached_blocks(ray_http):
    """Two replicas: with random routing each repeat would find its prefix cached only about half the time."""
    systems = [f"System prompt {i}: " + " ".join(f"rule {i}.{k} is to be kind" for k in range(12)) for i in range(4)]
    for i, system in enumerate(systems):
        complete(ray_http, prompt=system + " First question?", max_tokens=1)
        again = complete(ray_http, prompt=system + " A different, second question?", max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, (i, again["usage"])
    for i in range(4):  # a prompt_cache_key groups prompts whose first blocks differ
        key = f"user-{i}"
        complete(ray_http, prompt=f"{i} " + systems[i], max_tokens=1, prompt_cache_key=key)
        again = complete(ray_http, prompt=f"{i} " + systems[i] + " More.", max_tokens=1, prompt_cache_key=key)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, (i, again["usage"])


def test_metrics_show_each_replica_and_the_totals(ray_http):
    complete(ray_http, prompt="Hello", max_tokens=2)
    time.sleep(1.5)  # replicas post their stats every 0.5 s; the front reads them as often
    text = ray_http.get("/metrics").text
    assert "waferscale_replicas 2.0" in text
    per_replica = [line for line in text.splitlines() if line.startswith("waferscale_replica_waiting{replica=")]
    assert len(per_replica) == 2
    assert "\nwaferscale_waiting " in text and "\nwaferscale_kv_cache_usage " in text
    assert text.count("waferscale_replica_kv_cache_usage{replica=") == 2


def _engine_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:waferscale:engine"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _busy_replica_pid(http: httpx.Client) -> int:
    """The engine process of the replica running the most sequences now, as /metrics reports it (replica_info maps
    replica ids to processes): routing is by prompt, so any one replica may have been given none of them."""
    deadline = time.time() + 30
    while time.time() < deadline:
        text = http.get("/metrics").text
        infos = [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in re.findall(r"replica_info\{(.*)\}", text)]
        pids = {info["replica"]: info["pid"] for info in infos}
        running = re.findall(r'waferscale_replica_running\{replica="([^"]+)"\} (\S+)', text)
        busy = sorted((-float(v), r) for r, v in running if float(v) > 0 and r in pids)
        if busy:
            return int(pids[busy[0][1]])
        time.sleep(0.2)
    pytest.fail("no replica reported a running sequence within 30 s")


def test_a_killed_replica_fails_only_its_requests_with_503_and_is_replaced(ray_server, ray_http):
    """Runs last in this file: it kills one of the session's replicas and waits for Serve to replace it."""
    results: dict[int, tuple] = {}

    def run(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 150, "temperature": 0}
        with httpx.Client(base_url=ray_server.url, timeout=120) as c:
            if i % 2:
                r = c.post("/v1/completions", json=body)
                results[i] = (r.status_code, r.text)
                return
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            errors = [json.loads(d) for d in data if d != "[DONE]" and '"error"' in d]
            results[i] = (errors[0]["status_code"], json.dumps(errors[0])) if errors else (r.status_code, data[-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    before = _engine_pids()
    assert len(before) == 2
    killed = _busy_replica_pid(ray_http)  # a replica given none of the four would fail nothing
    assert killed in before
    os.kill(killed, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)  # nobody hangs
    codes = [results[i][0] for i in range(4)]
    assert set(codes) <= {200, 503} and 503 in codes, results
    assert all("engine_unavailable" in results[i][1] for i in range(4) if codes[i] == 503)
    for i in range(4):  # at once, the survivor serves everything new
        assert complete(ray_http, prompt=f"After {i}", max_tokens=4)["choices"][0]["text"]
    deadline = time.time() + 120  # Serve starts another replica; it loads the model before it serves
    while time.time() < deadline:
        pids = _engine_pids()
        if len(pids) == 2 and killed not in pids and "waferscale_replicas 2.0" in ray_http.get("/metrics").text:
            break
        time.sleep(1)
    else:
        pytest.fail("Serve did not replace the killed replica within 120 s")
