"""The rest of the /v1/completions contract: body encodings, limits, penalties, logit_bias, best_of, n-streams,
accepted-but-inert fields, and errors (including one after a stream started)."""

from __future__ import annotations

import gzip
import json

import httpx
import msgpack
import pytest
from conftest import MODEL, complete, sse_events

PROMPT = "It was a dark and stormy night"
LOOP = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"  # greedy repeats itself here
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


def post(http, content: bytes, content_type="application/json", **headers):
    return http.post("/v1/completions", content=content, headers={"content-type": content_type, **headers})


# ---------------------------------------------------------------- bodies


@pytest.mark.parametrize("ctype", ["application/msgpack", "application/vnd.msgpack", "application/x-msgpack"])
def test_msgpack_bodies_equal_json(http_f32, ctype):
    expected = complete(http_f32, **BODY)["choices"][0]["text"]
    r = post(http_f32, msgpack.packb(BODY), ctype)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("ctype", ["application/json", "application/msgpack"])
def test_gzip_bodies(http, ctype):
    raw = json.dumps(BODY).encode() if ctype == "application/json" else msgpack.packb(BODY)
    r = post(http, gzip.compress(raw), ctype, **{"content-encoding": "gzip"})
    assert r.status_code == 200, r.text


def test_msgpack_response_when_accepted(http):
    r = post(http, json.dumps(BODY).encode(), accept="application/msgpack")
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(r.content)["object"] == "text_completion"


@pytest.mark.parametrize(
    ("content", "ctype", "encoding", "status", "words"),
    [
        (b'{"model": ', "application/json", None, 400, "not valid JSON"),
        (b"\xc1", "application/msgpack", None, 400, "not valid msgpack"),
        (b"[1, 2]", "application/json", None, 400, "must be an object"),
        (msgpack.packb("text"), "application/msgpack", None, 400, "must be an object"),
        (b"", "application/json", None, 400, "empty"),
        (b"{}", "text/plain", None, 415, "unsupported content type"),
        (b"{}", "application/json", "br", 415, "unsupported content encoding"),
        (b"\x1f\x8b\x08garbage", "application/json", "gzip", 400, "gzip"),
        (gzip.compress(b'{"model":')[:-6], "application/json", "gzip", 400, "gzip"),
    ],
    ids=[
        "bad-json",
        "bad-msgpack",
        "json-array",
        "msgpack-string",
        "empty",
        "text-plain",
        "brotli",
        "bad-gzip",
        "truncated-gzip",
    ],
)
def test_undecodable_bodies_get_a_4xx_naming_the_problem(http, content, ctype, encoding, status, words):
    headers = {"content-encoding": encoding} if encoding else {}
    r = post(http, content, ctype, **headers)
    assert r.status_code == status
    err = r.json()
    assert err["status_code"] == status and words in err["error"]["message"]


def test_lone_surrogate_prompt_is_400(http):
    r = post(http, b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode())
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"]


def test_oversized_bodies_get_413(http):
    bomb = gzip.compress(b" " * (40 * 1024 * 1024))  # 40 MiB of spaces, 40 KiB on the wire
    r = post(http, bomb, "application/json", **{"content-encoding": "gzip"})
    assert r.status_code == 413 and r.json()["status_code"] == 413
    big = json.dumps({**BODY, "prompt": "x" * (33 * 1024 * 1024)}).encode()
    assert post(http, big).status_code == 413


def test_limits_on_prompts_and_candidates(http):
    r = http.post("/v1/completions", json={**BODY, "prompt": ["a"] * 65})
    assert r.status_code == 400 and "65 prompts" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={**BODY, "prompt": ["a"] * 8, "n": 20, "best_of": 20})
    assert r.status_code == 400 and "160 sequences" in r.json()["error"]["message"]


# ---------------------------------------------------------------- sampling controls


def test_penalties_follow_the_formula(http):
    """Greedy under penalties: the chosen token maximises logprob - count*frequency - (count>0)*presence."""
    freq, pres = 1.2, 0.6
    out = complete(
        http,
        prompt=LOOP,
        max_tokens=30,
        temperature=0,
        logprobs=20,
        frequency_penalty=freq,
        presence_penalty=pres,
    )
    lp = out["choices"][0]["logprobs"]
    counts: dict[str, int] = {}
    penalised_somewhere = False
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        adjusted = {t: v - counts.get(t, 0) * freq - (counts.get(t, 0) > 0) * pres for t, v in top.items()}
        assert adjusted[token] >= max(adjusted.values()) - 1e-3
        penalised_somewhere |= token != max(top, key=top.get)
        counts[token] = counts.get(token, 0) + 1
    assert penalised_somewhere  # the penalty changed at least one choice against plain greedy
    plain = complete(http, prompt=LOOP, max_tokens=30, temperature=0)["choices"][0]["text"]
    assert out["choices"][0]["text"] != plain


def test_logit_bias_bans_and_forces(cerebras):
    def tokens(**kw):
        out = cerebras.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, return_raw_tokens=True, **kw
        )
        return out.choices[0].tokens

    first = tokens()[0]
    assert first not in tokens(logit_bias={str(first): -100})
    assert tokens(logit_bias={"28": 100}) == [28, 28, 28, 28]


@pytest.mark.parametrize(
    ("bias", "words"), [({"abc": 1}, "'abc'"), ({"49152": 1}, "'49152'"), ({"5": 101}, "101")]
)
def test_bad_logit_bias_is_400_naming_it(http, bias, words):
    r = http.post("/v1/completions", json={**BODY, "logit_bias": bias})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_best_of_returns_the_candidate_with_the_best_mean_logprob(cerebras_f32):
    cerebras = cerebras_f32
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=8, min_tokens=8, temperature=1.0, seed=5, logprobs=0)
    three = cerebras.completions.create(**common, n=3)
    means = [sum(c.logprobs.token_logprobs) / 8 for c in three.choices]
    best = cerebras.completions.create(**common, best_of=3)
    assert len(best.choices) == 1
    assert best.choices[0].text == three.choices[means.index(max(means))].text
    assert best.usage.completion_tokens == 24  # every candidate counts


def test_best_of_rules(http):
    r = http.post("/v1/completions", json={**BODY, "n": 3, "best_of": 2})
    assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={**BODY, "best_of": 2, "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    assert complete(http, **BODY, n=2, best_of=2)["choices"][1]["index"] == 1


def test_n_streams_interleave_with_their_own_finish(http_f32):
    body = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=9, n=3)
    whole = complete(http_f32, **body)
    events = sse_events(http_f32, **body)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    order = []
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        finishes.setdefault(c["index"], []).append(c["finish_reason"])
        order.append(c["index"])
    assert {i: whole["choices"][i]["text"] for i in range(3)} == texts
    for i in range(3):
        assert finishes[i][-1] == "length" and all(f is None for f in finishes[i][:-1])
    assert order != sorted(order)  # chunks of different choices interleave


# ---------------------------------------------------------------- accepted fields


def test_accepted_fields_and_headers(cerebras_f32, http_f32, server_f32):
    out = cerebras_f32.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        user="user-42",
        prompt_cache_key="conv-1",
        reasoning_format="parsed",
        suffix="",
        cf_ray="ray-123",
        x_amz_cf_id="amz-9",
        x_delay_time=0.5,
    )
    assert out.choices[0].text == complete(http_f32, **BODY)["choices"][0]["text"]
    assert "user=user-42 trace=ray-123" in server_f32.log()


def test_suffix_is_not_supported(http):
    r = http.post("/v1/completions", json={**BODY, "suffix": "tail"})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


def test_grammar_root_names(http):
    r = http.post("/v1/completions", json={**BODY, "grammar_root": "yaml"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "grammar_root"]


def test_prompts_are_not_logged_by_default(http, server):
    complete(http, prompt="a very private prompt", max_tokens=1)
    assert "very private" not in server.log()


# ---------------------------------------------------------------- errors


def test_sdk_raises_the_matching_exception_for_each_status(cerebras, server):
    import cerebras.cloud.sdk as sdk

    with pytest.raises(sdk.BadRequestError):
        cerebras.completions.create(model=MODEL, prompt=PROMPT, suffix="x")
    with pytest.raises(sdk.NotFoundError):
        cerebras.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(sdk.UnprocessableEntityError):
        cerebras.completions.create(model=MODEL, prompt=PROMPT, temperature=3)
    with pytest.raises(sdk.InternalServerError):
        cerebras.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,  # greedy: a sampled end of text in the first two tokens would end it before the fault
            extra_headers={"X-Waferscale-Fault-After": "2"},
        )
    for content, ctype, status in ((b"{}", "text/plain", 415), (b"x" * 10, "application/json", 400)):
        r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": ctype})
        assert r.status_code == status
    with pytest.raises(sdk.APIStatusError) as info:
        cerebras.post("/v1/completions", cast_to=object, body={**BODY, "prompt": "x" * (33 * 1024 * 1024)})
    assert info.value.status_code == 413


def test_error_after_stream_start_is_an_error_chunk_then_done(http):
    events = []
    with http.stream(
        "POST",
        "/v1/completions",
        json={**BODY, "max_tokens": 10, "stream": True},
        headers={"X-Waferscale-Fault-After": "3"},
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert err["status_code"] == 500 and err["error"]["message"]
    assert "Traceback" not in err["error"]["message"] and "/" not in err["error"]["message"]
    assert any(json.loads(e).get("choices") for e in events[:-2])  # text flowed before the fault


def test_sdk_raises_on_an_error_chunk_mid_stream(cerebras):
    import cerebras.cloud.sdk as sdk

    stream = cerebras.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        stream=True,
        extra_headers={"X-Waferscale-Fault-After": "3"},
    )
    got = []
    with pytest.raises(sdk.InternalServerError):
        for chunk in stream:
            got.append(chunk)
    assert got
