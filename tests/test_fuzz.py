"""Fuzzed request bodies (JSON, msgpack, gzip; truncated, corrupted, nested, huge, wrong types): always an answer in
the spec's shape, 200 or 4xx, never a 5xx; the server keeps serving."""

from __future__ import annotations

import gzip
import json

import msgpack
import pytest
from conftest import MODEL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 49152
BASE = {
    "model": MODEL,
    "prompt": "Hi",
    "max_tokens": 1,
}  # max_tokens stays 1 (a null would run to the context)

odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=VOCAB + 5), max_size=5),
    st.just([]),
    st.just([[]]),
    st.just(""),
    st.just([VOCAB, 10**12]),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
fields = st.sampled_from(
    [
        "prompt",
        "temperature",
        "top_p",
        "n",
        "stop",
        "logprobs",
        "logit_bias",
        "seed",
        "echo",
        "best_of",
        "min_tokens",
        "stream",
        "grammar_root",
        "stream_options",
        "model",
        "user",
        "frequency_penalty",
    ]
)


@st.composite
def bodies(draw) -> tuple[bytes, dict[str, str]]:
    """A request body and its headers: a request with odd field values, encoded, possibly mangled."""
    obj = dict(BASE)
    for _ in range(draw(st.integers(0, 3))):
        obj[draw(fields)] = draw(odd_values)
    if obj.get("stream") is not True:
        obj.pop("stream", None)
    fmt = draw(st.sampled_from(["json", "msgpack"]))
    if fmt == "msgpack":
        try:
            raw = msgpack.packb(obj)
        except OverflowError:  # msgpack has no integers beyond 64 bits; send those as JSON
            fmt = "json"
    if fmt == "json":
        raw = json.dumps(obj, allow_nan=True).encode()
        ctype = "application/json"
    else:
        ctype = draw(
            st.sampled_from(["application/msgpack", "application/vnd.msgpack", "application/x-msgpack"])
        )
    mangle = draw(st.sampled_from(["none", "truncate", "flip", "utf8", "nest", "bignum"]))
    if mangle == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif mangle == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1 :]
    elif mangle == "utf8":
        raw = raw.replace(b"Hi", b"H\xff\xfe")
    elif mangle == "nest":
        depth = draw(st.sampled_from([100, 5000, 200000]))
        raw = (b"[" * depth + b"]" * depth) if fmt == "json" else (b"\x91" * depth + b"\xc0")
    elif mangle == "bignum":
        raw = raw.replace(b'"max_tokens": 1', b'"max_tokens": ' + b"9" * 5000)
    headers = {"content-type": ctype}
    if draw(st.booleans()):
        raw = gzip.compress(raw)
        if draw(st.booleans()):
            raw = raw[: len(raw) // 2]  # truncated gzip
        headers["content-encoding"] = "gzip"
    return raw, headers


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=bodies())
def test_fuzzed_bodies_get_200_or_a_4xx_in_the_spec_shape(http, case):
    raw, headers = case
    r = http.post("/v1/completions", content=raw, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code == 200:
        if not r.headers["content-type"].startswith("text/event-stream"):
            assert r.json()["choices"]
    elif r.status_code == 422:
        assert all(set(d) == {"loc", "msg", "type"} for d in r.json()["detail"])
    else:
        body = r.json()
        assert body["status_code"] == r.status_code and body["error"]["message"]


def _mp(obj) -> bytes:
    return msgpack.packb(obj)


# The hazards the issue names, each once, with the status it must get.
NAMED_CASES = {
    "truncated json": (b'{"model": "x", "prompt": "H', "application/json", 400),
    "truncated msgpack": (_mp(BASE)[:-3], "application/msgpack", 400),
    "oversized body": (b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}', "application/json", 413),
    "deeply nested json": (b"[" * 200000 + b"]" * 200000, "application/json", 400),
    "deeply nested msgpack": (b"\x91" * 200000 + b"\xc0", "application/msgpack", 400),
    "msgpack map keyed by an array": (b"\x81\x91\x01\x01", "application/msgpack", 400),
    "wrong type": (json.dumps({**BASE, "max_tokens": "many"}).encode(), "application/json", 422),
    "number with 5000 digits": (
        b'{"model": "m", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "application/json",
        400,
    ),
    "huge seed": (json.dumps({**BASE, "seed": 10**30}).encode(), "application/json", 200),
    "huge token id": (json.dumps({**BASE, "prompt": [10**30]}).encode(), "application/json", 400),
    "token id just past the vocabulary": (
        json.dumps({**BASE, "prompt": [VOCAB]}).encode(),
        "application/json",
        400,
    ),
    "invalid utf-8 in json": (b'{"model": "m", "prompt": "H\xff\xfe"}', "application/json", 400),
    "invalid utf-8 in msgpack": (_mp(BASE).replace(b"\xa2Hi", b"\xa2\xff\xfe"), "application/msgpack", 400),
    "empty prompt string": (json.dumps({**BASE, "prompt": ""}).encode(), "application/json", 200),
    "empty prompt list": (json.dumps({**BASE, "prompt": []}).encode(), "application/json", 400),
    "empty token list (BOS, as documented)": (
        json.dumps({**BASE, "prompt": [[]]}).encode(),
        "application/json",
        200,
    ),
    "array body": (b"[1, 2]", "application/json", 400),
}


@pytest.mark.parametrize("name", NAMED_CASES)
def test_named_bad_bodies_get_their_status(http, name):
    raw, ctype, status = NAMED_CASES[name]
    r = http.post("/v1/completions", content=raw, headers={"content-type": ctype})
    assert r.status_code == status, (name, r.status_code, r.text[:300])


def test_server_still_serves_after_the_fuzzing(http):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=BASE)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
