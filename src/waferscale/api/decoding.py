"""Request body decoding: JSON or msgpack, optionally gzip-compressed, into a plain dict; the body read as a stream
under a hard cap, whatever its framing; and the response type an `Accept` header asks for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool

from waferscale.api.body_parser import (
    JSON_TYPES,
    MSGPACK_TYPES,
    REQUEST_CONTENT_TYPES,
    BodyError,
    media_type,
    parse_body,
)
from waferscale.api.errors import APIError

log = logging.getLogger("waferscale.api")
MAX_BODY_BYTES = 32 * 1024 * 1024
INLINE_BYTES = 1 << 20  # bodies up to this size are parsed on a thread (json.loads of 1 MiB: ~2 ms)


def decode_body(
    body: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES
) -> dict:
    """The decoded object of a request body; a 4xx APIError that names the problem otherwise."""
    try:
        return parse_body(body, content_type, content_encoding, max_bytes)
    except BodyError as exc:
        raise _api_error(exc) from None


def _lowest_priority() -> None:
    """The parser process runs at nice 19: on a machine with few cores a parse at normal priority would take a
    core from the engine's OpenMP threads, and every decode step (which waits for all of them) would stall."""
    try:
        os.nice(19)
    except (AttributeError, OSError):
        pass


def _api_error(exc: BodyError) -> APIError:
    return APIError(exc.status_code, exc.message, param=exc.param, code=exc.code)


class BodyDecoder:
    """Decodes request bodies off the event loop. A thread would do for a small body, but parsing holds the GIL
    (json.loads of 30 MiB: ~70 ms at a stretch), and while it is held the engine thread cannot run between its
    torch calls, so every stream would miss a token; bodies over `inline_bytes` are parsed in a child process
    (started at first need), and only the parsed object comes back."""

    def __init__(self, inline_bytes: int = INLINE_BYTES, max_bytes: int = MAX_BODY_BYTES):
        self.inline_bytes, self.max_bytes = inline_bytes, max_bytes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    async def decode(self, body: bytes, content_type: str | None, content_encoding: str | None) -> dict:
        """`body` parsed (a thread for small ones, the child process for large ones); APIError for a bad body."""
        if len(body) <= self.inline_bytes:
            return await run_in_threadpool(decode_body, body, content_type, content_encoding, self.max_bytes)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor(), parse_body, body, content_type, content_encoding, self.max_bytes
            )
        except BodyError as exc:
            raise _api_error(exc) from None
        except concurrent.futures.process.BrokenProcessPool:  # the child died (killed?): a new one next time
            log.warning("the body parser process ended; starting a new one")
            self._reset()
            return await run_in_threadpool(decode_body, body, content_type, content_encoding, self.max_bytes)

    def close(self) -> None:
        self._reset()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn, not fork: forking a process that runs the engine's threads (OpenMP, torch) is unsafe
                context = multiprocessing.get_context("spawn")
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=context, initializer=_lowest_priority
                )
            return self._pool

    def _reset(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


async def read_limited(
    chunks: AsyncIterator[bytes], declared_length: str | None, max_bytes: int = MAX_BODY_BYTES
) -> bytes:
    """The body from its chunks (Content-Length, chunked or anything else), refused with 413 the moment it
    passes `max_bytes`: a declared length over the cap before a byte is read, else as the running count crosses
    it. At most `max_bytes` plus one chunk is ever held."""
    declared = (declared_length or "").strip()
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        if chunk:
            parts.append(chunk)
    return b"".join(parts)


def _accept_ranges(accept: str) -> list[tuple[str, float]]:
    out = []
    for item in accept.split(","):
        kind, *params = (p.strip() for p in item.split(";"))
        if not kind:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = min(1.0, max(0.0, float(value)))
                except ValueError:
                    q = 0.0  # an unreadable weight: treat the range as not acceptable
        out.append((kind.lower(), q))
    return out


def _quality(ranges: list[tuple[str, float]], kind: str) -> float:
    """The q-value `kind` gets: from the most specific range that matches it (RFC 9110 12.5.1); 0 if none."""
    main = kind.split("/", 1)[0]
    best, specificity = 0.0, -1
    for rng, q in ranges:
        if rng == kind:
            level = 2
        elif rng == f"{main}/*":
            level = 1
        elif rng == "*/*":
            level = 0
        else:
            continue
        if level > specificity:
            best, specificity = q, level
    return best


def wants_msgpack(accept: str | None) -> bool:
    """Whether to answer msgpack: only when a msgpack type has a higher q-value than JSON (JSON wins ties, a
    missing or empty header, `*/*`, and headers that accept neither)."""
    if not accept or not accept.strip():
        return False
    ranges = _accept_ranges(accept)
    packed = max(_quality(ranges, t) for t in MSGPACK_TYPES)
    return packed > 0 and packed > _quality(ranges, "application/json")


__all__ = [
    "BodyDecoder",
    "JSON_TYPES",
    "decode_body",
    "media_type",
    "read_limited",
    "wants_msgpack",
    "REQUEST_CONTENT_TYPES",
    "MSGPACK_TYPES",
]
