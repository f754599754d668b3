"""Request body decoding: JSON or msgpack, optionally gzip-compressed, into a plain dict; the body read as a stream
under a hard cap, whatever its framing; and the response type an `Accept` header asks for."""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator

import msgpack

from waferscale.api.errors import APIError

JSON_TYPES = ("application/json",)
MSGPACK_TYPES = ("application/msgpack", "application/vnd.msgpack", "application/x-msgpack")
REQUEST_CONTENT_TYPES = JSON_TYPES + MSGPACK_TYPES
MAX_BODY_BYTES = 32 * 1024 * 1024


def media_type(header: str | None) -> str:
    return (header or "application/json").split(";", 1)[0].strip().lower()


def decode_body(
    body: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES
):
    """The decoded object of a request body; a 4xx APIError that names the problem otherwise."""
    kind = media_type(content_type)
    if kind not in REQUEST_CONTENT_TYPES:
        raise APIError(
            415,
            f"unsupported content type {kind!r}; send one of: {', '.join(REQUEST_CONTENT_TYPES)}",
            param="content-type",
            code="unsupported_media_type",
        )
    if len(body) > max_bytes:
        raise APIError(413, f"request body is {len(body)} bytes; the limit is {max_bytes}")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = _gunzip(body, max_bytes)  # bounded: stops decompressing past max_bytes
    elif encoding not in ("identity", ""):
        raise APIError(
            415, f"unsupported content encoding {encoding!r}; send gzip or none", param="content-encoding"
        )
    if not body:
        raise APIError(400, "request body is empty; send a CompletionRequest object")
    try:
        if kind in JSON_TYPES:
            obj = json.loads(body)
        else:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # TypeError: a msgpack map keyed by an array or map (unhashable); ValueError covers JSON, over-long
        # integer literals and msgpack's ExtraData/FormatError/StackError.
        fmt = "JSON" if kind in JSON_TYPES else "msgpack"
        raise APIError(400, f"request body is not valid {fmt}: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"request body must be an object, got {type(obj).__name__}")
    return obj


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


def _gunzip(body: bytes, max_bytes: int) -> bytes:
    decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = decomp.decompress(body, max_bytes + 1)
    except zlib.error:
        raise APIError(400, "request body is not valid gzip") from None
    if len(out) > max_bytes:
        raise APIError(413, f"decompressed request body exceeds the limit of {max_bytes} bytes")
    if not decomp.eof:
        raise APIError(400, "request body is truncated gzip")
    return out


__all__ = [
    "decode_body",
    "media_type",
    "read_limited",
    "wants_msgpack",
    "REQUEST_CONTENT_TYPES",
    "MSGPACK_TYPES",
]
