"""Request body decoding: JSON or msgpack, gzip, and the 4xx for each malformed body."""

from __future__ import annotations

import gzip
import json

import msgpack
import pytest

from waferscale.api.decoding import decode_body
from waferscale.api.errors import APIError

BODY = {"model": "m", "prompt": "Hi", "max_tokens": 3}


def status(*args, **kw) -> int:
    with pytest.raises(APIError) as info:
        decode_body(*args, **kw)
    return info.value.status_code


def test_json_msgpack_and_gzip_decode_to_the_same_object():
    raw = json.dumps(BODY).encode()
    assert decode_body(raw, "application/json; charset=utf-8", None) == BODY
    assert decode_body(msgpack.packb(BODY), "application/vnd.msgpack", None) == BODY
    assert decode_body(gzip.compress(raw), None, "gzip") == BODY


def test_malformed_bodies_are_client_errors():
    assert status(b"{}", "text/plain", None) == 415
    assert status(b"{}", "application/json", "br") == 415
    assert status(b"", "application/json", None) == 400
    assert status(b"{nope", "application/json", None) == 400
    assert status(b"[1, 2]", "application/json", None) == 400
    assert status(b"\xc1", "application/msgpack", None) == 400
    assert status(b"not gzip", "application/json", "gzip") == 400
    assert status(gzip.compress(b"{}")[:-6], "application/json", "gzip") == 400


def test_size_limits_hold_before_and_after_decompression():
    assert status(b"x" * 101, "application/json", None, max_bytes=100) == 413
    bomb = gzip.compress(b" " * 10_000 + b"{}")
    assert len(bomb) < 100 and status(bomb, "application/json", "gzip", max_bytes=100) == 413
