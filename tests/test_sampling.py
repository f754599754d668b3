"""Sampling and generation controls: greedy, seed, top_p, min/max tokens, stop strings, logprobs, echo, prompts."""

from __future__ import annotations

from conftest import complete, sse_events

PROMPT = "It was a dark and stormy night"
CHAT = "<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n<|im_start|>assistant\n"


def text(out, i=0):
    return out["choices"][i]["text"]


def test_temperature_zero_is_greedy_and_repeatable(http):
    a = complete(http, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    b = complete(http, prompt=PROMPT, max_tokens=12, temperature=0)
    assert text(a) == text(b)
    lp = a["choices"][0]["logprobs"]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert list(top)[0] == token  # the chosen token is the most likely one


def test_same_seed_same_output_different_seed_differs(http):
    outs = [text(complete(http, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=s)) for s in (7, 7, 8, 9)]
    assert outs[0] == outs[1]
    assert len({outs[0], outs[2], outs[3]}) > 1


def test_tiny_top_p_keeps_only_the_most_likely_token(http):
    greedy = complete(http, prompt=PROMPT, max_tokens=12, temperature=0)
    nucleus = complete(http, prompt=PROMPT, max_tokens=12, temperature=1.5, top_p=1e-6, seed=3)
    assert text(nucleus) == text(greedy)


def test_eos_finishes_with_stop_and_min_tokens_masks_it(http):
    short = complete(http, prompt=CHAT, max_tokens=200, temperature=0)
    assert short["choices"][0]["finish_reason"] == "stop"
    n = short["usage"]["completion_tokens"]
    assert n < 200
    forced = complete(http, prompt=CHAT, max_tokens=200, temperature=0, min_tokens=n + 10)
    assert forced["usage"]["completion_tokens"] >= n + 10
    assert text(forced).startswith(text(short))


def test_max_tokens_limit_finishes_with_length(http):
    out = complete(http, prompt=PROMPT, max_tokens=5, temperature=0, return_raw_tokens=True)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5 == len(out["choices"][0]["tokens"])


def test_stop_string_is_cut_and_never_returned(http):
    full = text(complete(http, prompt=PROMPT, max_tokens=24, temperature=0))
    word = full.split()[3]  # a word from the middle of the greedy text
    cut = full.index(word)
    out = complete(http, prompt=PROMPT, max_tokens=24, temperature=0, stop=["zzzz", word])
    assert text(out) == full[:cut]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_stop_string_matches_across_token_boundaries(http):
    out = complete(http, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    tokens = out["choices"][0]["logprobs"]["tokens"]
    full = text(out)
    # the end of token 2 and the start of token 3: a stop string no single token contains
    stop = tokens[2][-2:] + tokens[3][:2]
    cut = full.index(stop)
    again = complete(http, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, logprobs=0)
    assert text(again) == full[:cut]
    assert "".join(again["choices"][0]["logprobs"]["tokens"]).startswith(text(again))


def test_streamed_stop_string_is_held_back(http):
    full = text(complete(http, prompt=PROMPT, max_tokens=24, temperature=0))
    stop = full.split()[4]
    events = sse_events(http, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert streamed == full[: full.index(stop)]
    assert stop not in streamed
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_zero_gives_tokens_without_top(http):
    out = complete(http, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = out["choices"][0]["logprobs"]
    assert lp["top_logprobs"] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6


def test_no_logprobs_by_default(http):
    assert complete(http, prompt=PROMPT, max_tokens=3)["choices"][0]["logprobs"] is None


def test_top_logprobs_hold_k_plus_sampled(http):
    out = complete(http, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=11, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    assert any(len(top) == 4 for top in lp["top_logprobs"])  # some sampled token fell outside the top 3
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) in (3, 4) and top[token] == value
        best = sorted(top.values(), reverse=True)[:3]
        assert best == sorted(best, reverse=True)


def test_text_offsets_count_from_the_prompt_start(http):
    out = complete(http, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0)
    lp = out["choices"][0]["logprobs"]
    expected, pos = [], len(PROMPT)
    for t in lp["tokens"]:
        expected.append(pos)
        pos += len(t)
    assert lp["text_offset"] == expected


def test_echo_prepends_prompt_and_scores_its_tokens(http):
    out = complete(http, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    plain = complete(http, prompt=PROMPT, max_tokens=4, temperature=0)
    assert text(out) == PROMPT + text(plain)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == out["usage"]["prompt_tokens"] + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][:3] == [0, 2, 6]  # "It", " was", " a"
    assert "".join(lp["tokens"]) == text(out)


def test_prompt_forms_and_prompt_major_indexes(http_f32, hf_tokenizer):
    http = http_f32  # float32: batched and single-sequence outputs are then bit-for-bit comparable
    ids = complete(http, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"][
        "tokens"
    ]
    assert len(ids) == 7
    base = text(complete(http, prompt=PROMPT, max_tokens=6, temperature=0))
    raw = complete(http, prompt=PROMPT, max_tokens=6, temperature=0, return_raw_tokens=True)
    prompt_ids = complete(http, prompt=[1, 2], max_tokens=0)  # a list of token ids is one prompt
    assert len(prompt_ids["choices"]) == 1
    many = complete(http, prompt=[PROMPT, "Once upon a time"], max_tokens=6, temperature=0, n=2)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert text(many, 0) == text(many, 1) == base
    assert text(many, 2) != base
    assert many["usage"]["prompt_tokens"] == 7 + len("Once upon a time".split())
    assert many["usage"]["completion_tokens"] == 24
    token_prompt = hf_tokenizer(PROMPT)["input_ids"]
    by_ids = complete(http, prompt=[token_prompt, token_prompt], max_tokens=6, temperature=0)
    assert text(by_ids, 0) == text(by_ids, 1) == base
    assert raw["choices"][0]["text"] == base


def test_return_raw_tokens_gives_ids_and_refuses_echo(http):
    out = complete(http, prompt=PROMPT, max_tokens=5, temperature=0, return_raw_tokens=True)
    tokens = out["choices"][0]["tokens"]
    assert len(tokens) == 5 and all(isinstance(t, int) for t in tokens)
    again = complete(http, prompt=tokens, max_tokens=0, echo=True)
    assert text(again) == text(out)
    r = http.post(
        "/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": PROMPT, "echo": True, "return_raw_tokens": True},
    )
    assert r.status_code == 400 and "return_raw_tokens" in r.json()["error"]["message"]
