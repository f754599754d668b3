"""Request body decoding: JSON or msgpack, optionally gzip-compressed, into a plain dict."""

from __future__ import annotations

import json
import zlib

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
            code="unsupported_media_type",
        )
    if len(body) > max_bytes:
        raise APIError(413, f"request body is {len(body)} bytes; the limit is {max_bytes}")
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        body = _gunzip(body, max_bytes)  # bounded: stops decompressing past max_bytes
    elif encoding not in ("identity", ""):
        raise APIError(415, f"unsupported content encoding {encoding!r}; send gzip or none")
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


__all__ = ["decode_body", "media_type", "REQUEST_CONTENT_TYPES", "MSGPACK_TYPES"]
