"""Predicted outputs on the in-process float32 engine: drafts verified in one forward never change the output."""

from __future__ import annotations

import pytest

from waferscale.engine import SamplingParams

PROMPT = "Here is a short story about a robot who learns to paint:"


def run(engine, params: SamplingParams, rid: str = "p") -> tuple[list[int], object, int]:
    """Token ids, the finished event and the number of steps of one request run alone."""
    engine.add_request(rid, engine.tokenizer.encode(PROMPT), params)
    ids, finished, steps = [], None, 0
    while engine.has_work():
        steps += 1
        for ev in engine.step():
            ids += ev.token_ids
            if ev.finished:
                finished = ev
    assert finished is not None and finished.error is None
    return ids, finished, steps


@pytest.fixture(scope="module")
def plain(engine):
    return run(engine, SamplingParams(max_tokens=40, min_tokens=40, temperature=0))


def test_a_correct_prediction_gives_the_same_greedy_output_in_fewer_steps(engine, plain):
    ids, ev, steps = plain
    out, pev, psteps = run(engine, SamplingParams(max_tokens=40, min_tokens=40, temperature=0, prediction=ids))
    assert out == ids
    assert pev.accepted_prediction_tokens > 20 and pev.rejected_prediction_tokens <= 2
    assert psteps < steps / 2
    assert ev.accepted_prediction_tokens == ev.rejected_prediction_tokens == 0
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("kind", ["edited", "unrelated", "shuffled"])
def test_a_wrong_prediction_never_changes_the_greedy_output(engine, plain, kind):
    ids = plain[0]
    prediction = {
        "edited": ids[:10] + [ids[10] + 1, ids[11] + 1] + ids[12:30] + engine.tokenizer.encode(" and then"),
        "unrelated": engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3),
        "shuffled": ids[20:] + ids[:20],
    }[kind]
    out, ev, _ = run(engine, SamplingParams(max_tokens=40, min_tokens=40, temperature=0, prediction=prediction))
    assert out == ids
    assert ev.rejected_prediction_tokens > 0 or kind != "edited"


def test_a_seeded_sample_is_the_same_with_a_prediction(engine):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11)
    ids, _, _ = run(engine, params)
    with_prediction, ev, _ = run(engine, SamplingParams(max_tokens=24, temperature=0.8, seed=11, prediction=ids))
    assert with_prediction == ids and ev.accepted_prediction_tokens > 0


def test_drafts_respect_max_tokens_and_stop_strings(engine, plain):
    ids = plain[0]
    out, ev, _ = run(engine, SamplingParams(max_tokens=7, temperature=0, prediction=ids))
    assert out == ids[:7] and ev.num_generated_tokens == 7
    text = engine.tokenizer.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    plain_stop, _, _ = run(engine, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    predicted_stop, _, _ = run(engine, SamplingParams(max_tokens=40, temperature=0, stop=[stop], prediction=ids))
    assert predicted_stop == plain_stop
