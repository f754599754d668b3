"""A streaming multipart/form-data reader for uploads: the file part goes to disk chunk by chunk as it arrives, so
an upload never sits whole in memory, and one over the size cap is refused as soon as it passes it. (python-multipart,
which Starlette would use, is not among the server's dependencies; this reads the one shape the SDKs send.)"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import BinaryIO

from waferscale.api.errors import APIError

MAX_FIELD_BYTES = 64 * 1024  # a plain field (purpose, expires_after[...]) is small
MAX_HEADER_BYTES = 16 * 1024


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # the file part's name; None if no file part came
    file_bytes: int = 0


def boundary_of(content_type: str | None) -> bytes:
    """The boundary of a multipart/form-data body, or a 400 that says what to send."""
    ctype = content_type or ""
    match = re.search(r'boundary="?([^";]+)"?', ctype)
    if not ctype.lower().startswith("multipart/form-data") or match is None:
        raise APIError(
            415 if not ctype.lower().startswith("multipart/form-data") else 400,
            "upload a file as multipart/form-data with the fields 'file' and 'purpose' "
            f"(got Content-Type {ctype or 'none'!r})",
            param="file",
        )
    return match.group(1).encode("latin-1")


def _disposition(headers: bytes) -> tuple[str, str | None]:
    """(field name, filename or None) from a part's headers."""
    text = headers.decode("utf-8", "replace")
    line = next((h for h in text.split("\r\n") if h.lower().startswith("content-disposition:")), "")
    name = re.search(r'\bname="([^"]*)"', line)
    filename = re.search(r'\bfilename="([^"]*)"', line)
    if name is None:
        raise APIError(400, "a multipart part has no Content-Disposition name", param="file")
    return name.group(1), filename.group(1) if filename else None


async def read_form(chunks: AsyncIterator[bytes], boundary: bytes, sink: BinaryIO, max_file_bytes: int,
                    file_field: str = "file") -> Form:  # fmt: skip
    """Read the whole body from `chunks`: the part named `file_field` is written to `sink`, the other parts are
    kept as text fields. 413 as soon as the file passes `max_file_bytes`."""
    form = Form()
    delim = b"\r\n--" + boundary
    buf = b"\r\n"  # so that the first boundary looks like every other one
    state = "preamble"
    name: str | None = None
    is_file = False
    value = bytearray()
    stream = aiter(chunks)
    done = False

    async def more() -> bool:
        nonlocal buf, done
        if done:
            return False
        try:
            chunk = await anext(stream)
        except StopAsyncIteration:
            done = True
            return False
        buf += chunk
        return True

    while True:
        if state == "preamble":
            at = buf.find(delim)
            if at < 0:
                buf = buf[-len(delim) :]
                if not await more():
                    raise APIError(
                        400, "the multipart body has no part: send 'file' and 'purpose'", param="file"
                    )
                continue
            buf = buf[at + len(delim) :]
            state = "after_delim"
        if state == "after_delim":
            while len(buf) < 2 and await more():
                pass
            if buf[:2] == b"--":
                return form
            if buf[:2] != b"\r\n":
                raise APIError(
                    400, "malformed multipart body (a boundary not followed by CRLF)", param="file"
                )
            buf = buf[2:]
            state = "headers"
        if state == "headers":
            at = buf.find(b"\r\n\r\n")
            if at < 0:
                if len(buf) > MAX_HEADER_BYTES or not await more():
                    raise APIError(400, "malformed multipart body (a part's headers never end)", param="file")
                continue
            name, filename = _disposition(buf[:at])
            buf = buf[at + 4 :]
            is_file = name == file_field
            if is_file:
                if form.filename is not None:
                    raise APIError(400, "send one file per upload", param="file")
                form.filename = filename or "upload.jsonl"
            value = bytearray()
            state = "body"
        if state == "body":
            at = buf.find(delim)
            data, rest = (
                (buf[:at], buf[at + len(delim) :])
                if at >= 0
                else (buf[: max(0, len(buf) - len(delim))], None)
            )
            if is_file:
                form.file_bytes += len(data)
                if form.file_bytes > max_file_bytes:
                    raise APIError(
                        413, f"the file is larger than this server's upload limit of {max_file_bytes} bytes; split "
                        "it into several files (and batches)", param="file", code="file_too_large",
                    )  # fmt: skip
                sink.write(data)
            else:
                value += data
                if len(value) > MAX_FIELD_BYTES:
                    raise APIError(
                        400, f"the form field {name!r} is longer than {MAX_FIELD_BYTES} bytes", param=name
                    )
            if rest is not None:
                if not is_file:
                    form.fields[name] = value.decode("utf-8", "replace")
                buf = rest
                state = "after_delim"
                continue
            buf = buf[len(data) :]
            if not await more():
                raise APIError(
                    400, "the multipart body ended inside a part (upload cut short?)", param="file"
                )
