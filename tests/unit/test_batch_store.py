"""The batch store and runner on a real SQLite database in a temporary folder, with no model: results committed once,
expiry, cancellation and the retention sweep."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from waferscale.api.batch_config import BatchSettings
from waferscale.api.batch_runner import BatchRunner
from waferscale.api.store import Store


def make_batch(store: Store, batch_id: str = "batch_1", n: int = 3, **fields) -> None:
    store.add_batch({
        "id": batch_id, "owner": "alice", "endpoint": "/v1/completions", "input_file_id": "file-x",
        "completion_window": "24h", "status": "in_progress", "created_at": int(time.time()),
        "expires_at": int(time.time()) + 86_400, "total": n, **fields,
    })  # fmt: skip
    store.add_requests(batch_id, [(i + 1, f"r{i}", json.dumps({"prompt": str(i)})) for i in range(n)])


def test_a_result_is_committed_once(tmp_path):
    store = Store(tmp_path)
    make_batch(store)
    assert store.record("batch_1", 1, "succeeded", {"custom_id": "r0"})
    assert not store.record(
        "batch_1", 1, "succeeded", {"custom_id": "r0"}
    )  # a second run of it changes nothing
    assert store.get_batch("batch_1")["completed"] == 1
    assert [p.line for p in store.pending("batch_1", 10, set())] == [2, 3]


def test_pending_leaves_out_the_lines_already_running(tmp_path):
    store = Store(tmp_path)
    make_batch(store, n=5)
    assert [p.line for p in store.pending("batch_1", 2, {1, 2})] == [3, 4]


def test_state_survives_reopening_the_database(tmp_path):
    store = Store(tmp_path)
    make_batch(store)
    store.record("batch_1", 2, "failed", {"custom_id": "r1"})
    again = Store(tmp_path)
    assert again.get_batch("batch_1")["failed"] == 1
    assert [p.custom_id for p in again.pending("batch_1", 10, set())] == ["r0", "r2"]
    assert again.integrity() == "ok"


def test_another_owner_sees_nothing(tmp_path):
    store = Store(tmp_path)
    make_batch(store)
    store.add_file("file-1", "alice", "a.jsonl", 3, "batch", None)
    assert store.get_batch("batch_1", "bob") is None and store.get_file("file-1", "bob") is None
    assert store.list_batches("bob", after=None, limit=10) == ([], False)


def test_the_sweep_deletes_expired_files_and_orphans(tmp_path):
    store = Store(tmp_path)
    for file_id, expires in (("file-old", 100), ("file-new", None)):
        store.file_path(file_id).write_text("{}\n")
        store.add_file(file_id, "alice", "x.jsonl", 3, "batch", expires)
    orphan = store.file_path("file-orphan.part")
    orphan.write_text("half an upload")
    runner = BatchRunner(store, BatchSettings(data_dir=tmp_path), None, lambda m: True)
    runner.sweep(int(time.time()) + 7200)
    assert store.get_file("file-old", "alice") is None and not store.file_path("file-old").exists()
    assert store.get_file("file-new", "alice") is not None and store.file_path("file-new").exists()
    assert not orphan.exists()


def run_until(runner: BatchRunner, store: Store, batch_id: str, statuses: tuple[str, ...]) -> dict:
    async def go() -> dict:
        runner.start()
        try:
            for _ in range(200):
                row = store.get_batch(batch_id)
                if row["status"] in statuses:
                    return row
                await asyncio.sleep(0.05)
            raise AssertionError(f"still {row['status']}")
        finally:
            await runner.stop()

    return asyncio.run(go())


def test_an_expired_batch_keeps_its_results_and_marks_the_rest_expired(tmp_path):
    store = Store(tmp_path)
    make_batch(store, expires_at=int(time.time()) - 1)
    store.record("batch_1", 1, "succeeded", {"custom_id": "r0"})
    runner = BatchRunner(store, BatchSettings(data_dir=tmp_path), None, lambda m: True)
    row = run_until(runner, store, "batch_1", ("expired",))
    assert (row["completed"], row["failed"]) == (1, 2) and row["expired_at"]
    errors = store.file_path(row["error_file_id"]).read_text().splitlines()
    assert [json.loads(x)["error"]["code"] for x in errors] == ["batch_expired", "batch_expired"]
    assert store.file_path(row["output_file_id"]).read_text().count("\n") == 1


@pytest.mark.parametrize("transient", [True, False])
def test_a_request_the_engine_cannot_take_now_runs_again(tmp_path, transient):
    from waferscale.api.errors import APIError

    store = Store(tmp_path)
    make_batch(store, n=1)
    calls = []

    async def execute(endpoint: str, body: dict, owner: str) -> dict:
        calls.append(body)
        if len(calls) == 1:
            raise APIError(503 if transient else 400, "no")
        return {"id": "cmpl-1", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    runner = BatchRunner(store, BatchSettings(data_dir=tmp_path), execute, lambda m: True)
    row = run_until(runner, store, "batch_1", ("completed",))
    assert (row["completed"], row["failed"], len(calls)) == ((1, 0, 2) if transient else (0, 1, 1))


def test_the_runner_stops_when_a_wake_up_meets_the_cancellation(tmp_path):
    """A wake-up that lands as the runner is cancelled (a request ending as the server stops) must not keep it
    running: Python < 3.12's wait_for swallows such a cancellation."""

    async def go() -> float:
        runner = BatchRunner(Store(tmp_path), BatchSettings(data_dir=tmp_path), None, lambda m: True)
        runner.start()
        await asyncio.sleep(0.3)  # its first pass done, the runner waits for a wake-up
        start = time.monotonic()
        # a cancel after 3 s makes a stuck stop return (its suppress swallows it): the test fails, not hangs
        asyncio.get_running_loop().call_later(3, asyncio.current_task().cancel)
        runner.wake()
        await runner.stop()
        return time.monotonic() - start

    assert asyncio.run(go()) < 2
