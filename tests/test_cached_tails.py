"""A short prompt, and a prompt found in the prefix cache but for its last few tokens (the same prompt again, the
next turn of a chat), run those tokens as decode rows, not through the prefill path, and answer as the prefill path
does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from waferscale.engine import LLMEngine, SamplingParams
from waferscale.engine.model_runner import ROWS_ATTENDED

PROMPT = " ".join(f"Fact {i}: the harbour opens at {i % 12 + 1} o'clock." for i in range(12))


@pytest.fixture(scope="module")
def loaded():
    from waferscale.models import load_model

    return load_model(None, dtype="float32", progress=False)


def _run(engine: LLMEngine, ids: list[int]) -> list[int]:
    return _run_scored(engine, ids)[0]


def _run_scored(engine: LLMEngine, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs."""
    engine.add_request(str(len(ids)), ids, SamplingParams(max_tokens=12, temperature=0, logprobs=0))
    out: list[int] = []
    scores: list[float] = []
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids
            scores += [lp.logprob for lp in ev.logprobs]
    return out, scores


def _as_rows_calls(engine: LLMEngine) -> list[tuple[int, int, bool]]:
    """Each prefill chunk the runner sees: tokens computed before it, its length, whether it ran as decode rows."""
    calls, decide = [], engine.runner._as_rows

    def recorded(seq, chunk):
        rows = decide(seq, chunk)
        calls.append((seq.num_computed, chunk, rows))
        return rows

    engine.runner._as_rows = recorded
    return calls


def test_a_repeated_prompts_uncached_tail_runs_as_decode_rows_with_the_same_answer(loaded):
    ids = loaded.tokenizer.encode(PROMPT)
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    calls = _as_rows_calls(engine)
    first = _run(engine, ids)
    assert not any(rows for _, _, rows in calls)  # nothing cached: the prompt runs through the prefill path
    calls.clear()
    again = _run(engine, ids)
    computed, chunk, rows = calls[0]
    assert computed > 0 and computed + chunk == len(ids) and rows  # the tail after the cached blocks
    assert again == first


def test_the_next_turn_of_a_chat_runs_as_decode_rows_and_answers_as_the_whole_prompt_does(loaded):
    ids = loaded.tokenizer.encode(PROMPT)
    turn = ids + loaded.tokenizer.encode(" And on Sunday?")
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    _run(engine, ids)
    calls = _as_rows_calls(engine)
    got = _run(engine, turn)
    assert calls[0][0] > 0 and calls[0][2]
    assert got == _run(LLMEngine(loaded, kv_cache_bytes=32 << 20), turn)  # a fresh cache: the whole prompt


def test_a_short_prompt_with_nothing_cached_runs_as_decode_rows_and_answers_as_the_prefill_path_does(loaded):
    ids = loaded.tokenizer.encode("The harbour opens at seven, and the ferry leaves at")
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    calls = _as_rows_calls(engine)
    got, scores = _run_scored(engine, ids)
    assert calls[0] == (0, len(ids), True)
    through_prefill = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    through_prefill.runner.rows_upto = 0
    want, want_scores = _run_scored(through_prefill, ids)
    assert got == want and scores == pytest.approx(want_scores, abs=1e-4)


def test_a_tail_whose_rows_would_read_too_much_context_takes_the_prefill_path(loaded):
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    seq = SimpleNamespace(num_computed=ROWS_ATTENDED // 8, params=SamplingParams(max_tokens=1))
    assert engine.runner._as_rows(seq, 4) and not engine.runner._as_rows(seq, 8)
