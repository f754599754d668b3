"""Supervision (in-process engine, no server): a failing step, a failing request and a dead engine thread.

Each fault is injected through the engine's test hooks (engine.faults), never through a request's parameters.
"""

from __future__ import annotations

import time

import pytest
from conftest import MODEL, run_to_end
from fastapi.testclient import TestClient

from waferscale.engine import AsyncEngine, ErrorKind, RequestError, SamplingParams
from waferscale.engine.faults import KillEngineThread


@pytest.fixture
def hooks(engine):
    """The engine's fault hooks, cleared (and the engine emptied) after the test."""
    yield engine.faults
    engine.faults.on_step = engine.faults.on_add = None
    engine.faults.fail_after.clear()
    engine.fail_all(RequestError(ErrorKind.INTERNAL, "test cleanup"))
    assert engine.blocks.num_used == 0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0)


def test_a_step_that_raises_fails_its_sequences_and_the_engine_carries_on(engine, hooks):
    ids = engine.tokenizer.encode("Once upon a time")
    steps = {"n": 0}

    def fault():
        steps["n"] += 1
        if steps["n"] == 3:
            raise RuntimeError("injected step fault")

    hooks.on_step = fault
    engine.add_request("a", ids, greedy(8))
    engine.add_request("b", ids, greedy(8))
    _, finished = run_to_end(engine)  # ends: the failed step is not retried forever
    assert {r: (ev.error.kind if ev.error else None) for r, ev in finished.items()} == {
        "a": ErrorKind.INTERNAL,
        "b": ErrorKind.INTERNAL,
    }
    assert "RuntimeError" in finished["a"].error.message and engine.blocks.num_used == 0
    assert engine.stats().failed_steps == 1
    engine.add_request("c", ids, greedy(4))
    texts, finished = run_to_end(engine)
    assert finished["c"].error is None and finished["c"].num_generated_tokens == 4 and texts["c"]


def test_a_request_that_fails_on_arrival_fails_alone(engine, hooks):
    def fault(request_id):
        if request_id == "bad":
            raise RuntimeError("injected add fault")

    hooks.on_add = fault
    ids = engine.tokenizer.encode("Hello")
    engine.add_request("bad", ids, greedy(4))
    engine.add_request("good", ids, greedy(4))
    _, finished = run_to_end(engine)
    assert finished["bad"].error.kind is ErrorKind.INTERNAL
    assert finished["good"].error is None and finished["good"].num_generated_tokens == 4


@pytest.fixture
def app(engine, hooks):
    from waferscale.api.completions import ServingContext
    from waferscale.api.server import create_app

    loaded = engine.loaded
    ctx = ServingContext(
        engine=AsyncEngine(engine),
        tokenizer=loaded.tokenizer,
        served_names=[MODEL],
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.config.vocab_size,
        fingerprint="fp_test",
    )
    with TestClient(create_app(ctx, []), raise_server_exceptions=False) as client:
        yield client


def test_a_prompt_larger_than_the_kv_pool_is_a_400_streamed_or_not(app, engine):
    capacity = (engine.blocks.num_blocks - 1) * engine.block_size
    body = {"model": MODEL, "prompt": [1] * (capacity + 10), "max_tokens": 4}
    assert capacity + 14 < engine.max_model_len
    for stream in (False, True):
        r = app.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text  # for a stream too: refused before the 200, not an error chunk
        assert "KV cache" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


def test_when_the_engine_thread_dies_health_is_503_and_requests_fail_at_once(app, hooks):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    assert app.get("/health").status_code == 200
    assert app.post("/v1/completions", json=body).status_code == 200

    def kill():
        raise KillEngineThread()

    hooks.on_step = kill
    r = app.post("/v1/completions", json=body)  # in flight when the thread dies: answered, not left waiting
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"]
    health = app.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    started = time.perf_counter()
    r = app.post("/v1/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    r = app.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 503
    assert time.perf_counter() - started < 5


def test_cached_tokens_count_once_per_prompt_and_never_exceed_prompt_tokens(app, engine):
    ids = engine.tokenizer.encode("The history of the printing press " * 40)[:161]  # 10 full blocks + 1 token
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "n": 4, "temperature": 1.0, "seed": 1}
    usage = app.post("/v1/completions", json=body).json()["usage"]
    # the first choice computes the prompt, the other three take its 160 cached tokens: counted once, not thrice
    assert usage["prompt_tokens"] == 161 and usage["prompt_tokens_details"]["cached_tokens"] == 160
