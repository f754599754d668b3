"""The Batch API through the OpenAI SDK against a real server: a round trip, validation, cancellation, ownership,
paging, the hosted /results shape, and a batch that survives its server being killed."""

from __future__ import annotations

import io
import json
import sqlite3
import time

import httpx
import openai
import pytest
from conftest import MODEL, Server

CHAT = "/v1/chat/completions"
KEYS = """
[keys.alice]
key = "sk-alice"

[keys.bob]
key = "sk-bob"

[keys.carol]
key = "sk-carol"
tokens_per_minute = 5

[keys.dave]
key = "sk-dave"
tokens_per_day = 30
"""
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    data = tmp_path_factory.mktemp("data")
    s = Server(
        "--api-keys-file", str(keys), "--data-dir", str(data), "--batch-min-requests", "2", "--batch-concurrency", "4",
        "--served-model-name", "llama3.1-8b",
    )  # fmt: skip
    yield s
    s.stop()


def client(server: Server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.url + "/v1", max_retries=0)


def line(custom_id: str, content: str = "Say hi", max_tokens: int = 3, url: str = CHAT, **body) -> dict:
    if url == CHAT:
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_completion_tokens": max_tokens,
        }
    else:
        payload = {"model": MODEL, "prompt": content, "max_tokens": max_tokens}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {**payload, "temperature": 0, **body},
    }


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def submit(c: openai.OpenAI, lines: list, endpoint: str = CHAT, **kw):
    f = c.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)


def wait(c: openai.OpenAI, batch_id: str, until=ENDED, timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = c.batches.retrieve(batch_id)
        if b.status in until:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch still {b.status} after {timeout} s: {b}")


def read_lines(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_a_batch_runs_every_request_once_and_writes_openai_output_lines(batch_server):
    c = client(batch_server)
    b = submit(c, [line(f"req-{i}", f"Count to {i}") for i in range(4)], metadata={"job": "eval"})
    assert b.status == "validating" and b.request_counts.total == 0
    assert b.expires_at - b.created_at == 86_400
    b = wait(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 4, 0)
    assert b.metadata == {"job": "eval"} and b.error_file_id is None
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out = read_lines(c, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == [f"req-{i}" for i in range(4)]
    for x in out:
        assert x["id"].startswith("batch_req_") and x["error"] is None
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
        assert x["response"]["request_id"] == body["id"]
    assert b.usage.output_tokens == 12
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_a_completions_batch_runs_through_the_completions_pipeline(batch_server):
    c = client(batch_server)
    b = wait(
        c,
        submit(
            c, [line(f"c{i}", "Once upon", url="/v1/completions") for i in range(2)], "/v1/completions"
        ).id,
    )
    assert b.status == "completed"
    assert {x["response"]["body"]["object"] for x in read_lines(c, b.output_file_id)} == {"text_completion"}


def test_a_request_the_pipeline_refuses_goes_to_the_error_file(batch_server):
    c = client(batch_server)
    b = wait(c, submit(c, [line("ok"), line("bad", temperature=7)]).id)
    assert b.status == "completed"
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 1)
    [err] = read_lines(c, b.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert "temperature" in err["response"]["body"]["error"]["message"]
    assert [x["custom_id"] for x in read_lines(c, b.output_file_id)] == ["ok"]


def test_results_answers_in_the_hosted_shape(batch_server):
    c = client(batch_server)
    b = wait(c, submit(c, [line("good"), line("bad", temperature=7)]).id)
    r = httpx.get(
        f"{batch_server.url}/v1/batches/{b.id}/results", headers={"Authorization": "Bearer sk-alice"}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    rows = {x["custom_id"]: x for x in map(json.loads, r.text.splitlines())}
    assert rows["good"]["status"] == "succeeded" and rows["good"]["response"]["object"] == "chat.completion"
    assert rows["bad"]["status"] == "failed" and "temperature" in rows["bad"]["error"]["message"]


BAD_LINES = [
    (b"{not json", "invalid_json_line"),
    (json.dumps([1, 2]).encode(), "invalid_json_line"),
    ({**line("x"), "custom_id": ""}, "missing_required_parameter"),
    ({**line("x"), "method": "GET"}, "invalid_method"),
    ({**line("x"), "url": "/v1/completions"}, "mismatched_url"),
    ({**line("x"), "body": "hello"}, "invalid_body"),
    (line("dup"), "duplicate_custom_id"),
    (line("x", model="no-such-model"), "model_not_found"),
    (line("x", model="llama3.1-8b"), "mixed_models"),  # the same weights under another name: still two models
    (line("x", stream=True), "stream_unsupported"),
    (b"\xff\xfe not utf-8", "invalid_encoding"),
]


@pytest.mark.parametrize("bad, code", BAD_LINES, ids=[c for _, c in BAD_LINES])
def test_a_bad_line_fails_the_batch_with_its_line_number(batch_server, bad, code):
    c = client(batch_server)
    b = wait(c, submit(c, [line("dup"), line("ok"), bad]).id)
    assert b.status == "failed" and b.failed_at
    [error] = b.errors.data
    assert (error.code, error.line) == (code, 3)


def test_a_batch_with_too_few_requests_fails(batch_server):
    c = client(batch_server)
    b = wait(c, submit(c, [line("only")]).id)
    assert b.status == "failed" and b.errors.data[0].code == "too_few_requests"


@pytest.mark.parametrize(
    "change, param",
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 5}}, "output_expires_after"),
    ],
)
def test_a_bad_create_request_is_a_400_naming_the_field(batch_server, change, param):
    c = client(batch_server)
    f = c.files.create(file=("b.jsonl", io.BytesIO(jsonl([line("a"), line("b")]))), purpose="batch")
    args = {"input_file_id": f.id, "endpoint": CHAT, "completion_window": "24h", **change}
    with pytest.raises(openai.BadRequestError) as err:
        c.batches.create(**args)
    assert err.value.body["param"] == param


def test_an_unknown_input_file_is_a_404(batch_server):
    with pytest.raises(openai.NotFoundError):
        client(batch_server).batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")


def test_another_keys_batch_is_not_found(batch_server):
    alice, bob = client(batch_server), client(batch_server, "sk-bob")
    b = submit(alice, [line("a"), line("b")])
    for call in (bob.batches.retrieve, bob.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(b.id)
    assert b.id not in [x.id for x in bob.batches.list()]
    with pytest.raises(openai.NotFoundError):  # nor can bob run a batch over alice's file
        bob.batches.create(input_file_id=b.input_file_id, endpoint=CHAT, completion_window="24h")
    wait(alice, b.id)


def test_list_pages_newest_first(batch_server):
    c = client(batch_server, "sk-bob")
    ids = [submit(c, [line("a"), line("b")]).id for _ in range(3)]
    listed = [b.id for b in c.batches.list(limit=1)]  # the SDK follows has_more with after=<last id>
    assert listed[:3] == ids[::-1]
    for batch_id in ids:
        wait(c, batch_id)


def test_cancel_keeps_finished_results_and_cancels_the_rest(batch_server):
    c = client(batch_server)
    b = submit(c, [line(f"r{i}", max_tokens=24) for i in range(40)])
    wait(c, b.id, until=("in_progress",))
    deadline = time.time() + 120
    while c.batches.retrieve(b.id).request_counts.completed < 1 and time.time() < deadline:
        time.sleep(0.1)
    cancelled = c.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    b = wait(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = read_lines(c, b.output_file_id)
    rest = read_lines(c, b.error_file_id)
    assert 1 <= len(done) < 40
    assert {x["error"]["code"] for x in rest} == {"batch_cancelled"}
    ids = [x["custom_id"] for x in done + rest]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40))  # every request once
    assert b.request_counts.completed == len(done)


def test_the_hosted_cancel_route_cancels_too(batch_server):
    c = client(batch_server)
    b = submit(c, [line(f"r{i}", max_tokens=24) for i in range(20)])
    r = httpx.delete(f"{batch_server.url}/v1/batches/{b.id}", headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    assert wait(c, b.id).status == "cancelled"


def test_a_finished_batch_cannot_be_cancelled(batch_server):
    c = client(batch_server)
    b = wait(c, submit(c, [line("a"), line("b")]).id)
    with pytest.raises(openai.BadRequestError, match="completed"):
        c.batches.cancel(b.id)


def test_a_killed_server_resumes_its_batch_without_running_a_request_twice(tmp_path):
    """The crash test at small size: SIGKILL mid-batch, twice, restarting on the same --data-dir."""
    n = 8
    args = ("--data-dir", str(tmp_path), "--batch-min-requests", "1", "--batch-concurrency", "1")
    server = Server(*args)
    try:
        c = client(server)
        b = submit(c, [line(f"k{i}", f"Write about {i}", max_tokens=4) for i in range(n)])
        for kill in range(2):
            deadline = time.time() + 120
            while (
                c.batches.retrieve(b.id).request_counts.completed < 2 * (kill + 1) and time.time() < deadline
            ):
                time.sleep(0.05)
            before = c.batches.retrieve(b.id)
            assert before.status == "in_progress" and before.request_counts.completed < n
            server.proc.kill()  # SIGKILL: no shutdown, no flush
            server.proc.wait()
            server._log.close()
            server = Server(*args)
            c = client(server)
            assert c.batches.retrieve(b.id).request_counts.completed >= before.request_counts.completed
        b = wait(c, b.id)
        assert b.status == "completed" and b.request_counts.completed == n
        out = read_lines(c, b.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"k{i}" for i in range(n))
    finally:
        server.stop()
    db = sqlite3.connect(tmp_path / "waferscale.sqlite3")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_batches_command_lists_the_keys_batches(batch_server):
    import subprocess
    import sys

    c = client(batch_server, "sk-bob")
    b = wait(c, submit(c, [line("a"), line("b")]).id)
    out = subprocess.run(
        [sys.executable, "-m", "waferscale", "batches", "--url", batch_server.url, "--api-key", "sk-bob"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    row = next(x for x in out.splitlines() if x.startswith(b.id))
    assert "completed" in row and "2 completed, 0 failed of 2" in row


def test_batch_tokens_do_not_count_against_the_minute_limits(batch_server):
    c = client(batch_server, "sk-carol")  # 5 tokens a minute: no interactive request fits
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2
        )
    b = wait(c, submit(c, [line("a"), line("b")]).id)
    assert (b.status, b.request_counts.completed) == ("completed", 2)


def test_batch_tokens_count_against_the_day_limits(batch_server):
    c = client(batch_server, "sk-dave")  # 30 tokens a day: one batch of two requests spends them
    first = wait(c, submit(c, [line("a"), line("b")]).id)
    assert first.status == "completed" and first.usage.total_tokens > 30
    with pytest.raises(openai.RateLimitError, match="per day"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2
        )
    second = submit(c, [line("c"), line("d")])
    time.sleep(3)
    second = c.batches.retrieve(second.id)
    assert (
        second.status == "in_progress" and second.request_counts.completed == 0
    )  # waits for the day to refill
    assert wait(c, c.batches.cancel(second.id).id).status == "cancelled"
