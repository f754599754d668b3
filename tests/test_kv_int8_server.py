"""`waferscale serve --kv-cache-dtype int8`: the built-in model answers the official SDK over loopback, and its pool
holds about twice the tokens a bfloat16 pool of the same --kv-cache-memory would (1.88x for 64-wide heads: a
float32 scale per token and head rides along), as /metrics and the start-up log line report."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import MODEL, Server, cerebras_for

from waferscale.engine.kv_cache import KVPool

MEMORY = 64 << 20


@pytest.fixture(scope="module")
def int8_server():
    s = Server("--kv-cache-dtype", "int8", "--kv-cache-memory", "64MiB", "--speculative", "none")
    yield s
    s.stop()


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next(row for row in text.splitlines() if row.startswith(f"waferscale_{name} "))
    return float(line.split()[1])


def test_the_sdk_gets_answers_from_an_int8_kv_cache(int8_server):
    with cerebras_for(int8_server.url) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
            temperature=0,
        )  # fmt: skip
        text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert text.choices[0].text.startswith(" Paris")  # greedy, as bf16 KV answers
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0


def test_the_pool_holds_about_twice_the_tokens_of_bfloat16(int8_server):
    tokens = _gauge(int8_server.url, "kv_cache_tokens")
    held = _gauge(int8_server.url, "kv_cache_bytes")
    assert MEMORY - (1 << 20) < held <= MEMORY  # int8 values and their scales, within the budget
    per_block = KVPool.bytes_per_block(30, 3, 64, torch.bfloat16, 16)  # the built-in model's layers and KV heads
    bf16_tokens = (MEMORY // per_block - 1) * 16
    assert 1.85 < tokens / bf16_tokens < 1.95
    log = int8_server.log()
    assert f"{int(tokens)} tokens in every layer" in log and "int8 with a float32 scale" in log
