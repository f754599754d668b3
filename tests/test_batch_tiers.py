"""Scheduling through a real server with one batch slot (--max-num-seqs 1): service tiers order interactive
requests (priority > default > flex), batch work yields to them, and queue_threshold refuses flex up front."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from conftest import MODEL, Server
from test_batch import line, submit, wait


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    s = Server(
        "--max-num-seqs", "1", "--data-dir", str(tmp_path_factory.mktemp("data")), "--batch-min-requests", "1",
        "--speculative", "none",  # one token a step: the timings below hold the one slot long enough
    )
    yield s
    s.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0, timeout=300)


def chat(c: openai.OpenAI, max_tokens: int, **kw):
    return c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_completion_tokens=max_tokens,
        temperature=0,
        extra_body={"min_completion_tokens": max_tokens},  # no early end: the timings below rely on the length
        **kw,
    )


def in_background(fn, done: dict, name: str) -> threading.Thread:
    def run() -> None:
        fn()
        done[name] = time.perf_counter()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_priority_goes_first_and_flex_waits(one_slot):
    c = client(one_slot)
    done: dict[str, float] = {}
    threads = [in_background(lambda: chat(c, 1000), done, "default")]
    time.sleep(1.0)  # the default request holds the one slot (1,000 tokens: seconds past the others' arrival)
    threads.append(in_background(lambda: chat(c, 2, service_tier="flex"), done, "flex"))
    time.sleep(0.5)
    threads.append(in_background(lambda: chat(c, 2, service_tier="priority"), done, "priority"))
    for t in threads:
        t.join()
    assert sorted(done, key=done.get) == ["priority", "default", "flex"]


def test_auto_is_served_at_default_and_says_so(one_slot):
    r = chat(client(one_slot), 2, service_tier="auto")
    assert r.model_extra["service_tier_used"] == "default"


@pytest.mark.parametrize("value", ["10", "20001", "soon"])
def test_a_queue_threshold_outside_50_to_20000_ms_is_a_400_for_flex(one_slot, value):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client(one_slot), 1, service_tier="flex", extra_headers={"queue_threshold": value})
    assert err.value.body["code"] == "invalid_queue_threshold"


def test_batch_work_yields_to_an_interactive_request(one_slot):
    c = client(one_slot)
    b = submit(c, [line(f"b{i}", "Tell me a long story.", max_tokens=150, min_completion_tokens=150) for i in range(4)])
    deadline = time.time() + 120
    while c.batches.retrieve(b.id).status != "in_progress" and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # a batch request holds the one slot now
    r = chat(c, 2)
    during = c.batches.retrieve(b.id)
    assert r.choices[0].finish_reason == "length"
    assert (
        during.status == "in_progress" and during.request_counts.completed < 4
    )  # it did not wait for the batch
    b = wait(c, b.id)
    assert (b.status, b.request_counts.completed) == ("completed", 4)  # the preempted request finished too


def test_queue_threshold_refuses_flex_when_the_queue_is_slower(one_slot):
    c = client(one_slot)
    threads = [
        in_background(lambda: chat(c, 120), {}, str(i)) for i in range(3)
    ]  # they queue behind each other
    for t in threads:
        t.join()
    with pytest.raises(openai.RateLimitError) as err:
        chat(c, 1, service_tier="flex", extra_headers={"queue_threshold": "50"})
    assert err.value.body["code"] == "queue_threshold_exceeded"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert chat(c, 1, service_tier="flex", extra_headers={"queue_threshold": "20000"}).choices
    assert chat(
        c, 1, extra_headers={"queue_threshold": "50"}
    ).choices  # default tier: the header does nothing
