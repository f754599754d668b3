"""Per-key limits on the HTTP side: a request's reservation (429 before anything is queued), its settlement and
usage when it ends, and the `x-ratelimit-*` headers on every response of an authenticated key."""

from __future__ import annotations

import logging
import math

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from waferscale.api.auth import SCOPE_KEY, Key
from waferscale.api.errors import APIError
from waferscale.api.limits import QuotaExceeded
from waferscale.api.pipeline import Run

log = logging.getLogger("waferscale.api")


def estimate(run: Run) -> int:
    """Tokens a request may use, as the hosted service estimates them: each prompt once, plus each sequence's
    max_tokens (already the context left where the request left it unset)."""
    prompts = sum(len(p) for p in run.prompts)
    return prompts + sum(run.params[s.prompt_index].max_tokens for s in run.seqs)


def reserve(request: Request, run: Run) -> None:
    """Take `run`'s estimate from its key's buckets, or 429 with Retry-After; the run gives back what it did not
    use, and counts its usage, when it ends."""
    key: Key | None = request.scope.get(SCOPE_KEY)
    if key is None:
        return
    try:
        reservation = key.quota.reserve(estimate(run))
    except QuotaExceeded as exc:
        key.usage.rate_limited += 1
        log.info("key %s refused: over its %s limit", key.name, exc.window)
        retry = {} if math.isinf(exc.retry_after) else {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        raise APIError(429, exc.message, param="quota", code=exc.code, headers=retry) from None
    key.usage.requests += 1
    before = run.on_finish

    def finished(run: Run) -> None:  # then the hook set before (a model's lease: api/models_registry.py)
        usage = run.usage()
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        key.usage.prompt_tokens += prompt
        key.usage.cached_tokens += cached
        key.usage.completion_tokens += completion
        reservation.settle(prompt + completion, prompt - cached + completion)
        if before is not None:
            before(run)

    run.on_finish = finished


class RateLimitHeaders:
    """ASGI middleware: the key's `x-ratelimit-*` headers on every response to an authenticated request, errors
    and streams included, read as the response starts (after the request's reservation, or its settlement)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            key: Key | None = scope.get(SCOPE_KEY)
            if message["type"] == "http.response.start" and key is not None and not key.quota.unlimited:
                extra = [(k.encode(), v.encode()) for k, v in key.quota.headers().items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_limits)
