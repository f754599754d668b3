"""Large bodies are parsed in a child process (the GIL stays free for the engine thread): same objects, same
errors, and a child that dies is replaced."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal

import msgpack
import pytest

from waferscale.api.decoding import BodyDecoder
from waferscale.api.errors import APIError

BIG = {"model": "m", "prompt": "word " * 400_000, "max_tokens": 3}  # 2 MB: over the 1 MiB inline limit


@pytest.fixture
def decoder():
    d = BodyDecoder()
    yield d
    d.close()


def test_a_large_body_is_parsed_in_a_child_process_into_the_same_object(decoder):
    raw = json.dumps(BIG).encode()
    assert asyncio.run(decoder.decode(raw, "application/json", None)) == BIG
    assert asyncio.run(decoder.decode(gzip.compress(msgpack.packb(BIG)), "application/msgpack", "gzip")) == BIG
    assert decoder._child is not None and decoder._child.proc.poll() is None  # the child did it, and still runs


def test_a_small_body_never_starts_the_child(decoder):
    assert asyncio.run(decoder.decode(b'{"model": "m"}', None, None)) == {"model": "m"}
    assert decoder._child is None


def test_a_large_malformed_body_gets_the_same_client_error(decoder):
    raw = json.dumps(BIG).encode()[:-1]
    with pytest.raises(APIError) as info:
        asyncio.run(decoder.decode(raw, "application/json", None))
    assert info.value.status_code == 400 and "not valid JSON" in info.value.message
    with pytest.raises(APIError) as info:
        asyncio.run(decoder.decode(json.dumps(BIG).encode(), "text/plain", None))
    assert info.value.status_code == 415 and info.value.param == "content-type"
    assert asyncio.run(decoder.decode(json.dumps(BIG).encode(), "application/json", None)) == BIG  # still serving


def test_a_killed_child_is_replaced_and_the_body_still_decoded(decoder):
    raw = json.dumps(BIG).encode()
    decoder.start()
    first = decoder._child.proc
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert asyncio.run(decoder.decode(raw, "application/json", None)) == BIG
    assert asyncio.run(decoder.decode(raw, "application/json", None)) == BIG  # and a new child after that
    assert decoder._child.proc.pid != first.pid


def test_closing_ends_the_child(decoder):
    decoder.start()
    proc = decoder._child.proc
    decoder.close()
    assert proc.poll() is not None
