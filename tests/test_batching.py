"""Continuous batching, the paged KV cache, prefix caching, preemption and disconnects, through real clients."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import MODEL, Server, complete

PROMPTS = [f"Write a short note number {i} about the sea, the wind and the" for i in range(12)]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_concurrent_requests_get_the_same_greedy_outputs_as_sequential(cerebras_f32):
    """float32: batch-invariant numbers need it (bfloat16 GEMMs round differently at different batch sizes)."""
    cerebras = cerebras_f32

    def one(prompt):
        out = cerebras.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        return out.choices[0].text

    sequential = [one(p) for p in PROMPTS[:6]]
    with ThreadPoolExecutor(12) as pool:
        concurrent = list(pool.map(one, PROMPTS[:6] * 2))
    assert concurrent == sequential * 2


def test_seeded_sampling_does_not_depend_on_the_batch(cerebras_f32):
    cerebras = cerebras_f32

    def one(prompt, seed=None):
        return (
            cerebras.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    alone = one(PROMPTS[0], seed=1234)
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, p) for p in PROMPTS[1:12]] + [pool.submit(one, PROMPTS[0], 1234)]
        assert futures[-1].result() == alone


def test_repeated_long_prompt_is_served_from_the_prefix_cache(http_f32, server_f32):
    long_prompt = " ".join(f"fact {i}: the sea is wide." for i in range(60))
    first = complete(http_f32, prompt=long_prompt, max_tokens=8, temperature=0)
    second = complete(http_f32, prompt=long_prompt, max_tokens=8, temperature=0)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 16 and cached % 16 == 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert metrics(server_f32.url)["waferscale_prefix_cache_hits_total"] > 0


def test_disconnected_streams_return_their_blocks(server):
    base = metrics(server.url)["waferscale_kv_blocks_used"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "stream": True}
    for _ in range(3):
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
    deadline = time.time() + 10
    while time.time() < deadline and metrics(server.url)["waferscale_kv_blocks_used"] > base:
        time.sleep(0.1)
    m = metrics(server.url)
    assert m["waferscale_kv_blocks_used"] == base and m["waferscale_running"] == 0


@pytest.fixture(scope="module")
def tiny_pool_server():
    s = Server("--kv-cache-memory", "8MiB", "--dtype", "float32")  # 11 blocks of 16 tokens (10 usable)
    yield s
    s.stop()


def test_a_pool_too_small_for_all_sequences_still_completes_every_request(tiny_pool_server):
    from cerebras.cloud.sdk import Cerebras

    client = Cerebras(api_key="x", base_url=tiny_pool_server.url, max_retries=0)

    def one(prompt):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, min_tokens=20, temperature=0
        )
        return out.choices[0].text

    # 6 sequences of 3 blocks each (a 14-token prompt and 20 tokens) against 10 usable blocks
    expected = [one(p) for p in PROMPTS[:3]]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, PROMPTS[:3] * 2))
    assert got == expected * 2
    assert metrics(tiny_pool_server.url)["waferscale_preemptions_total"] > 0


def test_bench_command_prints_and_writes_figures(server, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "waferscale",
            "bench",
            "--url",
            server.url,
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "output_tok_s" in r.stdout and "ttft_p50_ms" in r.stdout
    figures = json.loads(out.read_text())
    assert figures["errors"] == 0 and figures["requests"] == 4
    assert figures["output_tok_s"] > 0 and figures["ttft_p99_ms"] >= figures["ttft_p50_ms"] > 0
    assert figures["wall_s"] * figures["output_tok_s"] == pytest.approx(4 * 8)


def test_metrics_expose_latency_histograms(http, server):
    before = metrics(server.url)
    complete(http, prompt=PROMPTS[0], max_tokens=5, min_tokens=5)
    after = metrics(server.url)
    ttft, itl = "waferscale_time_to_first_token_seconds_count", "waferscale_inter_token_latency_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after[itl] == before[itl] + 4
    assert after['waferscale_time_to_first_token_seconds_bucket{le="+Inf"}'] == after[ttft]


def test_health_answers_fast_while_32_streams_decode(server):
    import threading

    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 64, "min_tokens": 64, "stream": True}
    stop = threading.Event()

    def stream():
        with httpx.Client(base_url=server.url, timeout=300) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=stream) for _ in range(32)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 20
        while metrics(server.url)["waferscale_running"] < 32 and time.time() < deadline:
            time.sleep(0.2)
        assert metrics(server.url)["waferscale_running"] >= 16
        latencies = []
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for _ in range(10):
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        assert sorted(latencies)[len(latencies) // 2] < 0.05, latencies
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def test_choices_of_one_prompt_share_its_blocks(engine):
    from conftest import run_to_end

    from waferscale.engine import SamplingParams

    ids = engine.tokenizer.encode("The history of the printing press " * 40)[:161]  # 10 full blocks + 1 token
    for k in range(4):  # what n=4 submits: four sequences of one prompt, all in the same step
        engine.add_request(f"c{k}", ids, SamplingParams(max_tokens=4, min_tokens=4, temperature=1.0, seed=k))
    while any(s.num_generated == 0 for s in engine.running) or engine.waiting:
        engine.step()
    # ten shared prompt blocks plus one block of its own per choice, not 4 x 11
    assert engine.blocks.num_used == 10 + 4
    _, finished = run_to_end(engine)
    assert sorted(ev.num_cached_tokens for ev in finished.values()) == [0, 160, 160, 160]
    assert engine.blocks.num_used == 0



def test_float32_logprobs_are_the_same_alone_and_beside_other_requests(engine):
    """In float32 a row's numbers do not depend on its step: a request decoded alone, and decoded in steps where other
    prompts prefill and decode beside it, gets bit-identical logprobs (MKL, which PyTorch would call, gives a row
    other bits at 1 row than at 20)."""
    from waferscale.engine import SamplingParams

    ids = engine.tokenizer.encode("Tell me about the history of lighthouses.")
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0, logprobs=0)
    others = {2: PROMPTS[0], 5: PROMPTS[1] + " rain"}  # step -> a prompt of over 16 tokens joining then

    def logprobs(rid: str, joining: dict[int, str]) -> list[float]:
        engine.add_request(rid, ids, params)
        got, step = [], 0
        while engine.has_work():
            if step in joining:
                engine.add_request(f"{rid}-{step}", engine.tokenizer.encode(joining[step]), params)
            got += [lp.logprob for ev in engine.step() if ev.request_id == rid for lp in ev.logprobs]
            step += 1
        return got

    logprobs("warm", {})  # the prompt's blocks cached, so that both runs below start from them alike
    alone = logprobs("alone", {})
    assert len(alone) == 10
    assert logprobs("busy", others) == alone


def test_a_client_that_leaves_before_its_body_is_read_is_no_server_error(server):
    """Closing the socket right after sending: no traceback in the log, and the server keeps serving."""
    import json
    import socket

    body = json.dumps({"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 3000, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    before = server.log().count("Traceback")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head + body)
    time.sleep(1)
    assert server.log().count("Traceback") == before
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert complete(http, prompt="Hi", max_tokens=2)["choices"][0]["text"] is not None
