"""The Files API (`/v1/files`): upload (multipart, streamed to disk under the size cap), list, retrieve, delete and
content. Files belong to the key that uploaded them; another key's file is a 404, as if it did not exist."""

from __future__ import annotations

import os
import time

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from waferscale.api.auth import ANONYMOUS, SCOPE_KEY
from waferscale.api.batch_config import BatchSettings
from waferscale.api.errors import APIError
from waferscale.api.multipart import boundary_of, read_form
from waferscale.api.store import Store, fsync_dir, new_id

PURPOSES = ("batch",)
MIN_TTL, MAX_TTL = 3600, 30 * 86_400  # expires_after.seconds, as OpenAI bounds it
MAX_LIST = 10_000


def owner_of(request: Request) -> str:
    """The name of the key that sent the request (ANONYMOUS on a server without keys)."""
    key = request.scope.get(SCOPE_KEY)
    return key.name if key is not None else ANONYMOUS


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise APIError(400, f"{name} must be an integer from {low} to {high} (got {raw!r})", param=name)
    return value


def not_found(kind: str, ident: str, param: str) -> APIError:
    return APIError(404, f"No such {kind}: {ident!r}", param=param, code=f"{kind}_not_found")


def _expiry(fields: dict[str, str], now: int, default_ttl: int) -> int:
    """expires_at from the form's expires_after[anchor] and expires_after[seconds] (the SDKs' bracketed form)."""
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return now + default_ttl
    if anchor != "created_at":
        raise APIError(400, "expires_after.anchor must be 'created_at'", param="expires_after.anchor")
    if seconds is None or not seconds.strip().isdigit() or not MIN_TTL <= int(seconds) <= MAX_TTL:
        raise APIError(
            400,
            f"expires_after.seconds must be an integer from {MIN_TTL} to {MAX_TTL} (got {seconds!r})",
            param="expires_after.seconds",
        )
    return now + int(seconds)


def install_files(app: FastAPI, store: Store, settings: BatchSettings, auth) -> None:
    """Add the /v1/files routes to `app` (outside the OpenAPI document, which holds the contracts' operations)."""
    route = {"dependencies": [Depends(auth)], "include_in_schema": False}

    @app.post("/v1/files", **route)
    async def upload(request: Request) -> dict:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.max_upload_bytes + (1 << 20):
            raise APIError(
                413,
                f"the upload is {int(length)} bytes; this server's limit is {settings.max_upload_bytes} bytes a file",
                param="file",
                code="file_too_large",
            )
        boundary = boundary_of(request.headers.get("content-type"))
        file_id = new_id("file-")
        final = store.file_path(file_id)
        part = final.with_name(final.name + ".part")
        try:
            with open(part, "wb") as sink:
                form = await read_form(request.stream(), boundary, sink, settings.max_upload_bytes)
                await run_in_threadpool(lambda: (sink.flush(), os.fsync(sink.fileno())))
            purpose = form.fields.get("purpose")
            if purpose is None:
                raise APIError(
                    400, "the form field 'purpose' is required; send purpose=batch", param="purpose"
                )
            if purpose not in PURPOSES:
                raise APIError(
                    400, f"purpose {purpose!r} is not supported here; use one of: {', '.join(PURPOSES)}",
                    param="purpose",
                )  # fmt: skip
            if form.filename is None:
                raise APIError(
                    400, "the form field 'file' is required (the JSONL file to upload)", param="file"
                )
            now = int(time.time())
            expires_at = _expiry(form.fields, now, settings.file_ttl)
            os.replace(part, final)
            fsync_dir(final.parent)
            return store.add_file(
                file_id, owner_of(request), form.filename, form.file_bytes, purpose, expires_at, now
            )
        except BaseException:
            part.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            raise

    @app.get("/v1/files", **route)
    async def list_files(request: Request) -> dict:
        limit = int_param(request, "limit", 20, 1, MAX_LIST)
        order = request.query_params.get("order", "asc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc' (got {order!r})", param="order")
        data, more = store.list_files(
            owner_of(request),
            after=request.query_params.get("after"),
            limit=limit,
            order=order,
            purpose=request.query_params.get("purpose"),
        )
        return {
            "object": "list",
            "data": data,
            "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    def find(request: Request, file_id: str) -> dict:
        found = store.get_file(file_id, owner_of(request))
        if found is None:
            raise not_found("file", file_id, "file_id")
        return found

    @app.get("/v1/files/{file_id}", **route)
    async def retrieve_file(request: Request, file_id: str) -> dict:
        return find(request, file_id)

    @app.delete("/v1/files/{file_id}", **route)
    async def delete_file(request: Request, file_id: str) -> dict:
        find(request, file_id)
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.get("/v1/files/{file_id}/content", **route)
    async def file_content(request: Request, file_id: str):
        found = find(request, file_id)
        return FileResponse(
            store.file_path(file_id), media_type="application/x-ndjson", filename=found["filename"]
        )
