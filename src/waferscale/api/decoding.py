"""Request body decoding: JSON or msgpack, optionally gzip-compressed, into a plain dict; the body read as a stream
under a hard cap, whatever its framing; and the response type an `Accept` header asks for."""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from waferscale.api.body_parser import (
    ANSWER,
    HEADER,
    JSON_TYPES,
    MSGPACK_TYPES,
    REQUEST_CONTENT_TYPES,
    BodyError,
    media_type,
    parse_body,
    recv_exact,
)
from waferscale.api.errors import APIError

log = logging.getLogger("waferscale.api")
MAX_BODY_BYTES = 32 * 1024 * 1024
INLINE_BYTES = 1 << 20  # bodies up to this size are parsed on a thread (json.loads of 1 MiB: ~2 ms)
PARSER_SCRIPT = Path(__file__).with_name("body_parser.py")


def decode_body(
    body: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES
) -> dict:
    """The decoded object of a request body; a 4xx APIError that names the problem otherwise."""
    try:
        return parse_body(body, content_type, content_encoding, max_bytes)
    except BodyError as exc:
        raise _api_error(exc) from None


def _api_error(exc: BodyError) -> APIError:
    return APIError(exc.status_code, exc.message, param=exc.param, code=exc.code)


class ParserProcess:
    """A child process running body_parser.py as a script, over a Unix socket: only the standard library and
    msgpack are imported there, so it starts in a fraction of a second. The server's side of a parse is two
    sendall calls and recv_into calls (the GIL released while they wait) and one pickle.loads of the answer."""

    def __init__(self):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # subprocess, not multiprocessing: its pipes and feeder threads hold the GIL for tens of ms per 30 MiB
            # (measured), and spawn re-imports the server's main module in the child
            self.proc = subprocess.Popen(
                [sys.executable, str(PARSER_SCRIPT), str(child.fileno())],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent

    def parse(self, body: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int) -> dict:
        """The parsed object; BodyError for a bad body; ChildGone when the child died (or was killed) meanwhile."""
        ct, ce = (content_type or "").encode(), (content_encoding or "").encode()
        try:
            self.sock.sendall(HEADER.pack(len(ct), len(ce), len(body), max_bytes) + ct + ce)
            self.sock.sendall(body)
            (size,) = ANSWER.unpack(recv_exact(self.sock, ANSWER.size))
            ok, value = pickle.loads(recv_exact(self.sock, size))
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            raise ChildGone(str(exc)) from None
        if not ok:
            raise BodyError(*value)
        return value

    def close(self) -> None:
        self.sock.close()  # the child reads EOF and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ChildGone(Exception):
    """The parser process ended before it answered."""


class BodyDecoder:
    """Decodes request bodies off the event loop. A thread would do for a small body, but parsing holds the GIL
    (json.loads of 30 MiB: ~70 ms at a stretch), and while it is held the engine thread cannot run between its
    torch calls, so every stream would miss a token; bodies over `inline_bytes` are parsed in a child process
    (ParserProcess, started by start() or at first need; one body at a time), and only the parsed object comes
    back."""

    def __init__(self, inline_bytes: int = INLINE_BYTES, max_bytes: int = MAX_BODY_BYTES):
        self.inline_bytes, self.max_bytes = inline_bytes, max_bytes
        self._child: ParserProcess | None = None
        self._lock = threading.Lock()  # one parse at a time in the child

    def start(self) -> None:
        """Start the child now (the server does at startup: later, its start would cost the first large body)."""
        with self._lock:
            self._ensure()

    async def decode(self, body: bytes, content_type: str | None, content_encoding: str | None) -> dict:
        """`body` parsed (a thread for small ones, the child process for large ones); APIError for a bad body."""
        if len(body) <= self.inline_bytes:
            return await run_in_threadpool(decode_body, body, content_type, content_encoding, self.max_bytes)
        try:
            return await run_in_threadpool(self._parse_in_child, body, content_type, content_encoding)
        except BodyError as exc:
            raise _api_error(exc) from None

    def _parse_in_child(self, body: bytes, content_type: str | None, content_encoding: str | None) -> dict:
        with self._lock:
            try:
                return self._ensure().parse(body, content_type, content_encoding, self.max_bytes)
            except ChildGone as exc:  # killed? a new child next time; this body on this thread
                log.warning("the body parser process ended (%s); starting a new one", exc)
                self._stop()
            except OSError as exc:  # could not start one: parse here
                log.warning("cannot start the body parser process (%s); parsing on a thread", exc)
        return parse_body(body, content_type, content_encoding, self.max_bytes)

    def _ensure(self) -> ParserProcess:
        if self._child is None:
            self._child = ParserProcess()
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.close()

    def close(self) -> None:
        with self._lock:
            self._stop()


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
