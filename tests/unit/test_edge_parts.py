"""The HTTP edge without a server: bodies read under a cap, Accept negotiation, prompts refused before they are
tokenized in full, logprob token names, integer logit_bias keys, and param on errors."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from waferscale.api.chat import validate_chat_request
from waferscale.api.completions import _prompts, logprobs_block
from waferscale.api.decoding import MAX_BODY_BYTES, decode_body, read_limited, wants_msgpack
from waferscale.api.errors import APIError
from waferscale.api.pipeline import ServingContext, resolve_logit_bias
from waferscale.api.schemas import CompletionRequest
from waferscale.api.tokens import token_name
from waferscale.engine import TokenLogprob
from waferscale.models.tokenizer import ModelTokenizer

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    """The built-in model's tokenizer: from the converted cache when there, else from loading the model."""
    from waferscale.models.loader import cache_root, load_model

    for folder in sorted((cache_root() / "converted").glob(f"{MODEL}-*")):
        if (folder / "waferscale_tokenizer.json").is_file():
            return ModelTokenizer.load_saved(folder)
    return load_model(None, progress=False).tokenizer


@pytest.fixture
def ctx(tok) -> ServingContext:
    return ServingContext(
        engine=None,
        tokenizer=tok,
        served_names=[MODEL],
        max_model_len=8192,
        vocab_size=tok.vocab_size,
        fingerprint="",
    )


# ---------------------------------------------------------------- bodies


async def _chunks(total: int, size: int, sent: list[int]):
    while sent[0] < total:
        n = min(size, total - sent[0])
        sent[0] += n
        yield b"x" * n


def test_a_streamed_body_is_refused_as_it_crosses_the_cap():
    sent = [0]
    with pytest.raises(APIError) as info:
        asyncio.run(read_limited(_chunks(10 * MAX_BODY_BYTES, 1 << 20, sent), None))
    assert info.value.status_code == 413
    assert sent[0] <= MAX_BODY_BYTES + (1 << 20)  # never read past the chunk that crossed it


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    sent = [0]
    with pytest.raises(APIError) as info:
        asyncio.run(read_limited(_chunks(100, 10, sent), str(MAX_BODY_BYTES + 1)))
    assert info.value.status_code == 413 and sent[0] == 0


def test_a_body_under_the_cap_is_read_whole():
    sent = [0]
    assert asyncio.run(read_limited(_chunks(5000, 7, sent), None)) == b"x" * 5000


# ---------------------------------------------------------------- Accept


@pytest.mark.parametrize(
    ("accept", "packed"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("application/json", False),
        ("application/msgpack", True),
        ("application/x-msgpack", True),
        ("application/vnd.msgpack", True),
        ("application/json, application/msgpack;q=0.1", False),
        ("application/msgpack;q=0.1, application/json", False),
        ("application/json;q=0.5, application/msgpack", True),
        ("application/msgpack, application/json", False),  # a tie: JSON
        ("application/msgpack, */*;q=0.1", True),
        ("application/msgpack;q=0, application/json", False),
        ("application/json;q=0, application/msgpack", True),
        ("text/html, application/msgpack;q=0.9", True),
        ("application/*;q=0.2, application/msgpack", True),
        ("application/msgpack;q=bogus", False),
        ("text/x-msgpack-notes", False),  # no substring matching
    ],
)
def test_accept_is_negotiated_with_q_values(accept, packed):
    assert wants_msgpack(accept) is packed


# ---------------------------------------------------------------- prompts that cannot fit


@pytest.fixture
def calls(tok, monkeypatch) -> list[int]:
    """The length of every text the tokenizer encodes and every id list it decodes, for the test's duration."""
    seen: list[int] = []
    inner, decode = tok.tokenizer, tok.decode

    class Spy:
        def __getattr__(self, name):
            return getattr(inner, name)

        def encode(self, text, *args, **kwargs):
            seen.append(len(text))
            return inner.encode(text, *args, **kwargs)

        def encode_batch(self, texts, *args, **kwargs):
            seen.extend(len(t) for t in texts)
            return inner.encode_batch(texts, *args, **kwargs)

    def spy_decode(ids, *args, **kwargs):
        seen.append(len(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "tokenizer", Spy())
    monkeypatch.setattr(tok, "decode", spy_decode)
    return seen


LONG = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB, ~400k tokens


def test_a_string_prompt_that_cannot_fit_is_refused_before_full_tokenization(ctx, calls):
    with pytest.raises(APIError) as info:
        _prompts(CompletionRequest(model=MODEL, prompt=LONG), ctx)
    err = info.value
    assert err.status_code == 400 and err.code == "context_length_exceeded" and err.param == "prompt"
    assert "8192" in err.message
    assert max(calls) < len(LONG) // 4, calls  # only a prefix was tokenized


def test_a_token_id_prompt_longer_than_the_context_is_refused_before_it_is_decoded(ctx, calls):
    with pytest.raises(APIError) as info:
        _prompts(CompletionRequest(model=MODEL, prompt=[42] * 100_000), ctx)
    err = info.value
    assert err.status_code == 400 and err.code == "context_length_exceeded" and err.param == "prompt"
    assert "100000" in err.message and "8192" in err.message
    assert calls == []  # neither decoded nor checked id by id


@pytest.mark.parametrize(
    "text",
    [
        "word " * 8000,  # fits: under the context, longer than the first prefix tried
        "x" * 200_000,  # one unbroken word proves nothing from a prefix: tokenized whole, as before
        "héllo wörld, ünïcode ☃ " * 3000,
    ],
)
def test_prompts_that_may_fit_are_tokenized_exactly_as_before(ctx, tok, text):
    try:
        prompts = _prompts(CompletionRequest(model=MODEL, prompt=text), ctx)
    except APIError as err:  # refused: only when it truly does not fit
        assert len(tok.encode(text)) >= ctx.max_model_len, err.message
        return
    assert prompts[0].ids == tok.encode(text)


def test_the_prefix_count_never_exceeds_the_whole_count(tok):
    from waferscale.api.pipeline import prompt_overflows

    for text in (
        "a b " * 40_000,
        "Hello, world!\n\n  " * 20_000,
        "日本語のテキスト、" * 30_000,
        "🙂 x" * 60_000,
    ):
        known = prompt_overflows(tok.tokenizer, text, 8192, add_special_tokens=True)
        assert known is not None and known <= len(tok.encode(text))


def test_a_chat_that_cannot_fit_is_refused_in_the_hosted_words(ctx, calls):
    from waferscale.api.chat import plan_chat
    from waferscale.models.chat_template import ChatTemplate

    ctx.chat_template = ChatTemplate.for_tokenizer(ctx.tokenizer)
    req = validate_chat_request({"model": MODEL, "messages": [{"role": "user", "content": LONG}]})
    with pytest.raises(APIError) as info:
        plan_chat(req, ctx)
    err = info.value
    assert err.status_code == 400 and err.code == "context_length_exceeded" and err.param == "messages"
    assert err.message.startswith(
        "Please reduce the length of the messages or completion. Current length is "
    )
    assert err.message.endswith(" while limit is 8192")
    assert max(calls) < len(LONG) // 4, calls


def test_prompts_are_tokenized_without_holding_the_gil(ctx, tok):
    """Tokenizing a long prompt must leave the other threads (the event loop, the engine) running."""
    import threading
    import time

    text = "All work and no play makes Jack a dull boy. " * 20_000  # 880 kB: a second or more to tokenize
    ctx.max_model_len = 10**6
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    try:
        prompts = _prompts(CompletionRequest(model=MODEL, prompt=text), ctx)
    finally:
        done.set()
        ticker.join()
    took = time.perf_counter() - start
    assert prompts[0].ids == tok.encode(text)
    assert prompts[0].offsets == tok.encode_with_offsets(text)[1]
    assert max(gaps) < max(0.5, took / 3), (max(gaps), took)


# ---------------------------------------------------------------- logprob token names


def _byte_tokens(tok: ModelTokenizer) -> list[int]:
    """Two single-byte tokens that are not whole UTF-8 text (both decode to U+FFFD)."""
    ids = [i for i in range(tok.vocab_size) if tok.token_text(i) == "\ufffd"]
    assert len(ids) >= 2
    return ids[:2]


def test_byte_tokens_are_named_by_their_bytes(tok):
    a, b = _byte_tokens(tok)
    name_a, name_b = token_name(tok, a, "\ufffd"), token_name(tok, b, "\ufffd")
    assert name_a.startswith("bytes:\\x") and name_a != name_b
    assert token_name(tok, tok.encode("hello")[0], "hello") == "hello"


def test_top_logprobs_keys_stay_distinct(tok):
    a, b = _byte_tokens(tok)
    entry = TokenLogprob(a, "\ufffd", -0.5, top=[(a, "\ufffd", -0.5), (b, "\ufffd", -1.5), (100, "x", -2.0)])
    block = logprobs_block([entry], 0, 3, tok)
    top = block["top_logprobs"][0]
    assert len(top) == 3 and block["tokens"][0] in top and top[block["tokens"][0]] == -0.5
    assert sorted(top.values()) == [-2.0, -1.5, -0.5]  # the lower byte token keeps its own key and value


# ---------------------------------------------------------------- logit_bias from msgpack


def test_integer_logit_bias_keys_from_msgpack_are_accepted_and_checked(ctx):
    body = msgpack.packb({"model": MODEL, "prompt": "hi", "logit_bias": {1234: 5, "17": -3}})
    obj = decode_body(body, "application/msgpack", None)
    req = CompletionRequest.model_validate(obj)
    assert resolve_logit_bias(req.logit_bias, ctx) == {1234: 5.0, 17: -3.0}
    chat = validate_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": obj["logit_bias"]}
    )
    assert resolve_logit_bias(chat.logit_bias, ctx) == {1234: 5.0, 17: -3.0}
    bad = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "logit_bias": {10**9: 1}})
    with pytest.raises(APIError) as info:
        resolve_logit_bias(bad.logit_bias, ctx)
    assert info.value.param == "logit_bias"


# ---------------------------------------------------------------- param


@pytest.mark.parametrize(
    ("ctype", "encoding", "param"),
    [("text/plain", None, "content-type"), ("application/json", "br", "content-encoding")],
)
def test_unsupported_encodings_name_their_header(ctype, encoding, param):
    with pytest.raises(APIError) as info:
        decode_body(b"{}", ctype, encoding)
    assert info.value.status_code == 415 and info.value.param == param


def test_a_chat_prompt_over_the_context_names_messages(ctx):
    from waferscale.api.chat import plan_chat
    from waferscale.models.chat_template import ChatTemplate

    ctx.chat_template = ChatTemplate.for_tokenizer(ctx.tokenizer)
    ctx.max_model_len = 20  # a short conversation overflows it; too short for a prefix to settle anything
    req = validate_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 3}]}
    )
    with pytest.raises(APIError) as info:
        plan_chat(req, ctx)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    assert "while limit is 20" in info.value.message


def test_an_sse_event_stays_one_line_whatever_characters_the_text_holds():
    """httpx's iter_lines splits at str.splitlines()'s line ends (U+2028, NEL, ...): the event's JSON escapes them."""
    import json

    from waferscale.api.pipeline import sse

    body = {"text": "a\u2028b\u2029c\x85d\x1ce\x1df\x1eg\x0bh\x0ci é"}
    event = sse(body)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert len(event.strip().splitlines()) == 1
    assert json.loads(event[len("data: "):]) == body
