"""Runs batches: validates new ones, keeps up to `concurrency` of their requests on the engine at the lowest
priority, commits each result as it ends, writes the output and error files, and carries out cancellation, expiry
and the retention sweep. Everything it knows is in the Store, so after a crash it picks up where the database says:
requests with a result are never run again, the others run (again)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool

from waferscale.api.batch_config import BatchSettings
from waferscale.api.batch_input import check_file, request_rows
from waferscale.api.errors import APIError, flat_error_body
from waferscale.api.store import Store, fsync_dir, new_id

log = logging.getLogger("waferscale.batch")
RETRY_AFTER = (
    1.0  # seconds before a request the engine could not take (overloaded, restarting) is tried again
)
TRANSIENT = (503,)  # statuses that mean "not now", not "this request is wrong": the request runs again later

Execute = Callable[
    [str, dict, str], Awaitable[dict]
]  # (endpoint, body, owner) -> the response body; raises APIError


def error_line(custom_id: str, code: str, message: str) -> dict:
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


class BatchRunner:
    def __init__(self, store: Store, settings: BatchSettings, execute: Execute, served: Callable[[str], bool],
                 draining: Callable[[], bool] = lambda: False,
                 paused: Callable[[str], bool] = lambda owner: False):  # fmt: skip
        self.store, self.settings, self.execute, self.served = store, settings, execute, served
        self.draining, self.paused = draining, paused
        self.inflight: dict[tuple[str, int], asyncio.Task] = {}
        self._busy: set[str] = set()  # batches being validated or finalized (off the event loop)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._swept = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        # the loop also ends on its own: Python < 3.12's wait_for can swallow a cancellation
        self._stopping = True
        tasks = [t for t in (self._task, *self.inflight.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._tick()
            except Exception:
                log.exception("batch runner step failed; trying again")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)

    # ------------------------------------------------------------------ one pass over the batches
    async def _tick(self) -> None:
        now = time.time()
        if now - self._swept >= self.settings.sweep_interval:
            self._swept = now
            await run_in_threadpool(self.sweep, int(now))
        for b in self.store.batches_in(("validating",)):
            if b["id"] not in self._busy:
                self._background(b["id"], self._validate(b))
        for b in self.store.batches_in(("cancelling",)):
            if b["id"] not in self._busy:
                self._stop_requests(b["id"])
                self._background(
                    b["id"], self._close(b, "cancelled", "batch_cancelled", "the batch was cancelled")
                )
        for b in self.store.batches_in(("finalizing",)):  # a finalization cut short by a crash
            if b["id"] not in self._busy:
                self._background(b["id"], self._finalize(b, "completed"))
        running = [b for b in self.store.batches_in(("in_progress",)) if b["id"] not in self._busy]
        for b in running:
            if b["expires_at"] is not None and now >= b["expires_at"]:
                self._stop_requests(b["id"])
                self._background(b["id"], self._close(b, "expired", "batch_expired", "the batch expired (24 h window) "
                                                      "before this request ran"))  # fmt: skip
        if self.draining():
            return
        for b in running:
            if b["id"] in self._busy:
                continue
            mine = {line for (bid, line) in self.inflight if bid == b["id"]}
            free = 0 if self.paused(b["owner"]) else self.settings.concurrency - len(self.inflight)
            todo = self.store.pending(b["id"], free, mine) if free > 0 else []
            for req in todo:
                key = (b["id"], req.line)
                self.inflight[key] = asyncio.create_task(self._run_one(b, req.line, req.custom_id, req.body))
            if not todo and not mine and not self.store.pending(b["id"], 1, set()):
                self._background(b["id"], self._finalize(b, "completed"))

    def _background(self, batch_id: str, job: Awaitable[None]) -> None:
        self._busy.add(batch_id)

        async def run() -> None:
            try:
                await job
            except Exception:
                log.exception("batch %s: step failed; it is tried again", batch_id)
            finally:
                self._busy.discard(batch_id)
                self.wake()

        asyncio.create_task(run())

    def _stop_requests(self, batch_id: str) -> None:
        """Abort the batch's requests on the engine (their results are not wanted any more)."""
        for key in [k for k in self.inflight if k[0] == batch_id]:
            self.inflight.pop(key).cancel()

    # ------------------------------------------------------------------ one request
    async def _run_one(self, batch: dict, line: int, custom_id: str, body: dict) -> None:
        key = (batch["id"], line)
        try:
            try:
                answer = await self.execute(batch["endpoint"], body, batch["owner"])
            except APIError as exc:
                if exc.status_code in TRANSIENT:
                    log.info("batch %s line %d: %s; it runs again", batch["id"], line, exc.message)
                    await asyncio.sleep(RETRY_AFTER)
                    return
                error = flat_error_body(exc.status_code, exc.message, param=exc.param, code=exc.code)
                result = {
                    "id": new_id("batch_req_"),
                    "custom_id": custom_id,
                    "response": {
                        "status_code": exc.status_code,
                        "request_id": new_id("req_"),
                        "body": {"error": error},
                    },
                    "error": None,
                }
                self.store.record(batch["id"], line, "failed", result)
                return
            except Exception as exc:
                log.exception("batch %s line %d failed", batch["id"], line)
                error = flat_error_body(500, f"generation failed: {type(exc).__name__}")
                result = {
                    "id": new_id("batch_req_"),
                    "custom_id": custom_id,
                    "response": {"status_code": 500, "request_id": new_id("req_"), "body": {"error": error}},
                    "error": None,
                }
                self.store.record(batch["id"], line, "failed", result)
                return
            result = {
                "id": new_id("batch_req_"),
                "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": answer.get("id"), "body": answer},
                "error": None,
            }
            self.store.record(batch["id"], line, "succeeded", result, answer.get("usage"))
        finally:
            if self.inflight.get(key) is asyncio.current_task():
                del self.inflight[key]
            self.wake()

    # ------------------------------------------------------------------ validation
    async def _validate(self, batch: dict) -> None:
        path = self.store.file_path(batch["input_file_id"])
        if not path.exists():
            self.store.set_status(batch["id"], "failed", only_from=("validating",), failed_at=int(time.time()),
                                  errors=_errors([{"code": "file_not_found", "message": f"the input file "
                                                   f"{batch['input_file_id']!r} was deleted", "param": "input_file_id",
                                                   "line": None}]))  # fmt: skip
            return
        s = self.settings
        checked = await run_in_threadpool(
            check_file, path, batch["endpoint"], max_line_bytes=s.max_line_bytes, min_requests=s.min_requests,
            max_requests=s.max_requests, served=self.served,
        )  # fmt: skip
        if checked.errors:
            self.store.set_status(
                batch["id"], "failed", only_from=("validating",), failed_at=int(time.time()),
                errors=_errors(checked.errors),
            )  # fmt: skip
            return

        def insert() -> None:
            self.store.delete_batch_results(batch["id"])  # a validation cut short by a crash starts over
            for rows in request_rows(path):
                self.store.add_requests(batch["id"], rows)

        await run_in_threadpool(insert)
        self.store.set_status(
            batch["id"], "in_progress", only_from=("validating",), in_progress_at=int(time.time()),
            total=checked.count, model=checked.model,
        )  # fmt: skip

    # ------------------------------------------------------------------ the end of a batch
    async def _close(self, batch: dict, status: str, code: str, message: str) -> None:
        """Cancelled or expired: the requests without a result get `code` in the error file; then finalize."""
        self.store.close_pending(batch["id"], status, lambda line, cid: error_line(cid, code, message))
        await self._finalize(batch, status)

    async def _finalize(self, batch: dict, status: str) -> None:
        """Write the output and error files from the committed results, then register them and end the batch in one
        transaction (a crash before that leaves files no row names, which the sweep removes)."""
        now = int(time.time())
        if status == "completed":
            self.store.set_status(
                batch["id"], "finalizing", only_from=("in_progress", "finalizing"), finalizing_at=now
            )
        files = await run_in_threadpool(self._write_results, batch)
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
        fields = {stamp: int(time.time())}
        for f in files:
            fields["output_file_id" if f["kind"] == "output" else "error_file_id"] = f["id"]
        self.store.finish(batch["id"], status, files, **fields)
        log.info("batch %s %s", batch["id"], status)

    def _write_results(self, batch: dict) -> list[dict]:
        out = []
        for kind, outcomes in (("output", ("succeeded",)), ("error", ("failed", "expired", "cancelled"))):
            file_id = new_id("file-")
            path = self.store.file_path(file_id)
            size = 0
            with open(path, "wb") as f:
                for row in self.store.results(batch["id"], outcomes):
                    data = row["result"].encode("utf-8") + b"\n"
                    f.write(data)
                    size += len(data)
                f.flush()
                os.fsync(f.fileno())
            if kind == "error" and size == 0:
                path.unlink()
                continue
            now = int(time.time())
            out.append({
                "kind": kind, "id": file_id, "owner": batch["owner"], "filename": f"{batch['id']}_{kind}.jsonl",
                "bytes": size, "purpose": f"batch_{kind}", "created_at": now,
                "expires_at": now + (batch.get("result_ttl") or self.settings.result_ttl),
            })  # fmt: skip
        fsync_dir(self.store.files_dir)
        return out

    # ------------------------------------------------------------------ retention
    def sweep(self, now: int) -> None:
        """Delete expired files, and files on disk that no row names (left by a crash) after an hour."""
        for file_id in self.store.expired_files(now):
            self.store.delete_file(file_id)
        for path in self.store.orphan_paths(now - 3600):
            path.unlink(missing_ok=True)


def _errors(items: list[dict]) -> str:
    return json.dumps({"object": "list", "data": items})


def with_priority(run, priority: int) -> None:
    """Every sequence of a planned run at `priority`."""
    run.params = [dataclasses.replace(p, priority=priority) for p in run.params]
