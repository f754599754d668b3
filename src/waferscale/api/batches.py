"""The Batch API (`/v1/batches`): create, retrieve, list, cancel (both the hosted `DELETE` and OpenAI's
`POST …/cancel`) and the hosted `GET …/results`; plus `install_batch_api`, which adds these routes and the Files
API to an app and gives back the service the app's lifespan starts and stops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from waferscale.api.auth import Keyring
from waferscale.api.batch_config import BatchSettings
from waferscale.api.batch_runner import BatchRunner, with_priority
from waferscale.api.chat import ChatRun, plan_chat, validate_chat_request
from waferscale.api.completions import CompletionRun, plan_request, validate_request
from waferscale.api.errors import APIError
from waferscale.api.files import MAX_TTL, MIN_TTL, install_files, int_param, not_found, owner_of
from waferscale.api.models_registry import ModelRegistry
from waferscale.api.store import TERMINAL, Store, new_id
from waferscale.engine.params import BATCH_PRIORITY

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOWS = ("24h",)
MAX_METADATA = 16


def nice_thread() -> None:
    """This thread at nice 10 (Linux: a thread is a task with its own nice value); nothing where that fails."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def batch_object(row: dict) -> dict:
    """The batch as the API returns it (OpenAI's object, which the hosted one follows)."""
    out = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
    }
    for name in ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                 "cancelling_at", "cancelled_at"):  # fmt: skip
        out[name] = row[name]
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    out["model"] = row["model"]
    out["usage"] = {
        "input_tokens": row["input_tokens"],
        "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
        "output_tokens": row["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": row["input_tokens"] + row["output_tokens"],
    }
    return out


def check_metadata(metadata) -> str | None:
    """Up to 16 pairs, keys up to 64 characters; a value is any JSON value up to 512 characters as JSON (OpenAI's
    strings, and the hosted example's list)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise APIError(400, "metadata must be an object of key-value pairs", param="metadata")
    if len(metadata) > MAX_METADATA:
        raise APIError(
            400, f"metadata has {len(metadata)} keys; the limit is {MAX_METADATA}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > 64:
            raise APIError(
                400, f"metadata key {key[:20]!r}... is longer than 64 characters", param="metadata"
            )
        if len(value if isinstance(value, str) else json.dumps(value)) > 512:
            raise APIError(400, f"metadata value of {key!r} is longer than 512 characters", param="metadata")
    return json.dumps(metadata)


def _result_ttl(value) -> int | None:
    if value is None:
        return None
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("anchor") != "created_at"
        or not isinstance(seconds, int)
        or not (MIN_TTL <= seconds <= MAX_TTL)
    ):
        raise APIError(
            400,
            f"output_expires_after must be {{'anchor': 'created_at', 'seconds': {MIN_TTL}..{MAX_TTL}}}",
            param="output_expires_after",
        )
    return seconds


async def _never_disconnected() -> bool:
    return False


class BatchService:
    """The store, the runner and the request pipeline a batch line goes through."""

    def __init__(self, models: ModelRegistry, settings: BatchSettings, keyring: Keyring):
        self.models, self.settings, self.keyring = models, settings, keyring
        self.store = Store(settings.directory())
        self.runner: BatchRunner | None = None
        # batch lines are templated and tokenized on their own threads at nice 10: never queued ahead of an
        # interactive request in the shared thread pool, and behind it for CPU (not idle class: that would starve
        # while the engine decodes the batch, and the batch would run in waves)
        self._planner = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="batch-plan", initializer=nice_thread
        )

    async def execute(self, endpoint: str, body: dict, owner: str) -> dict:
        """One batch line through the same validation, planning and engine path as an interactive request, at the
        batch priority; its tokens count against the owner's day limits and usage."""
        chat = endpoint == "/v1/chat/completions"
        req = validate_chat_request(body) if chat else validate_request(body)
        async with self.models.lease(req.model) as lease:  # its model, loaded (and kept) while the line runs
            ctx, loop = lease.ctx, asyncio.get_running_loop()
            if chat:
                run = ChatRun(await loop.run_in_executor(self._planner, plan_chat, req, ctx), ctx)
            else:
                run = CompletionRun(await loop.run_in_executor(self._planner, plan_request, req, ctx), ctx)
            with_priority(run.run, BATCH_PRIORITY)
            answer = await run.collect(_never_disconnected)
        key = self.keyring.named(owner)
        if key is not None:
            usage = answer["usage"]
            prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            key.quota.charge(prompt + completion, prompt - cached + completion)
            key.usage.requests += 1
            key.usage.prompt_tokens += prompt
            key.usage.cached_tokens += cached
            key.usage.completion_tokens += completion
        return answer

    def paused(self, owner: str) -> bool:
        """Whether the owner's day limits are spent: its batches wait until they refill."""
        key = self.keyring.named(owner)
        return key is not None and key.quota.day_wait() > 0

    def start(self) -> None:
        self.runner = BatchRunner(
            self.store,
            self.settings,
            self.execute,
            self.models.serves,
            lambda: self.models.draining,
            self.paused,
        )
        self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        self._planner.shutdown(wait=False, cancel_futures=True)

    def wake(self) -> None:
        if self.runner is not None:
            self.runner.wake()


def install_batch_api(
    app: FastAPI, models: ModelRegistry, auth, settings: BatchSettings | None = None
) -> BatchService:
    """Add the Files and Batch API routes to `app` (outside its OpenAPI document, which holds the contracts'
    operations); the caller starts and stops the returned service with the app."""
    settings = settings or BatchSettings()
    service = BatchService(models, settings, auth.keyring)
    store = service.store
    install_files(app, store, settings, auth)
    route = {"dependencies": [Depends(auth)], "include_in_schema": False}

    @app.post("/v1/batches", **route)
    async def create_batch(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body must be a JSON object", param="body") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", param="body")
        owner = owner_of(request)
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise APIError(400, "input_file_id is required: the id of a file uploaded with purpose=batch",
                           param="input_file_id")  # fmt: skip
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint {endpoint!r} is not supported; use one of: {', '.join(ENDPOINTS)}",
                           param="endpoint")  # fmt: skip
        window = body.get("completion_window")
        if window not in WINDOWS:
            raise APIError(
                400, f"completion_window must be '24h' (got {window!r})", param="completion_window"
            )
        metadata = check_metadata(body.get("metadata"))
        result_ttl = _result_ttl(body.get("output_expires_after"))
        found = store.get_file(input_file_id, owner)
        if found is None:
            raise not_found("file", input_file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id!r} has purpose {found['purpose']!r}; upload the input with "
                           "purpose=batch", param="input_file_id")  # fmt: skip
        if store.count_active(owner) >= settings.max_active_batches:
            raise APIError(
                429, f"this key has {settings.max_active_batches} batches in progress, the limit; wait for one to end "
                "or cancel one", param="batches", code="too_many_active_batches", headers={"Retry-After": "60"},
            )  # fmt: skip
        now = int(time.time())
        batch_id = new_id("batch_")
        store.add_batch({
            "id": batch_id, "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": window, "status": "validating", "created_at": now,
            "expires_at": now + settings.window, "metadata": metadata, "result_ttl": result_ttl,
        })  # fmt: skip
        service.wake()
        return batch_object(store.get_batch(batch_id))

    def find(request: Request, batch_id: str) -> dict:
        row = store.get_batch(batch_id, owner_of(request))
        if row is None:
            raise not_found("batch", batch_id, "batch_id")
        return row

    @app.get("/v1/batches", **route)
    async def list_batches(request: Request) -> dict:
        limit = int_param(request, "limit", 20, 1, 100)
        rows, more = store.list_batches(
            owner_of(request), after=request.query_params.get("after"), limit=limit
        )
        data = [batch_object(r) for r in rows]
        return {
            "object": "list",
            "data": data,
            "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    @app.get("/v1/batches/{batch_id}", **route)
    async def retrieve_batch(request: Request, batch_id: str) -> dict:
        return batch_object(find(request, batch_id))

    async def cancel(request: Request, batch_id: str) -> dict:
        row = find(request, batch_id)
        if row["status"] in ("cancelling", "cancelled"):
            return batch_object(row)
        if not store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"),
                                cancelling_at=int(time.time())):  # fmt: skip
            row = find(request, batch_id)
            raise APIError(400, f"batch {batch_id!r} is {row['status']}; only a validating or in-progress batch can "
                           "be cancelled", param="batch_id", code="batch_not_cancellable")  # fmt: skip
        service.wake()
        return batch_object(find(request, batch_id))

    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"], **route)
    app.add_api_route("/v1/batches/{batch_id}", cancel, methods=["DELETE"], **route)

    @app.get("/v1/batches/{batch_id}/results", **route)
    async def batch_results(request: Request, batch_id: str):
        """The hosted service's shape: {custom_id, status, response | error} a line, every request that ran."""
        row = find(request, batch_id)
        if row["status"] not in TERMINAL:
            raise APIError(400, f"batch {batch_id!r} is {row['status']}; its results are ready once it has ended",
                           param="batch_id", code="batch_not_finished")  # fmt: skip

        def lines():
            for r in store.results(batch_id, ("succeeded", "failed", "expired")):
                yield (
                    json.dumps(hosted_line(r["outcome"], json.loads(r["result"])), ensure_ascii=False) + "\n"
                )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return service


def hosted_line(outcome: str, result: dict) -> dict:
    """A stored (OpenAI-shaped) result line in the hosted /results shape."""
    if outcome == "succeeded":
        return {
            "custom_id": result["custom_id"],
            "status": "succeeded",
            "response": result["response"]["body"],
        }
    if outcome == "expired":
        return {"custom_id": result["custom_id"], "status": "expired",
                "error": {"code": "timeout", "message": result["error"]["message"]}}  # fmt: skip
    error = (result.get("response") or {}).get("body", {}).get("error") or result.get("error") or {}
    return {
        "custom_id": result["custom_id"],
        "status": "failed",
        "error": {
            "code": error.get("code") or error.get("type") or "failed",
            "message": error.get("message", ""),
        },
    }
