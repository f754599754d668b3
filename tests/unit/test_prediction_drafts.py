"""Draft proposals from a predicted output (prompt-lookup style), with no model."""

from __future__ import annotations

from waferscale.engine.prediction import propose

PRED = [10, 11, 12, 13, 14, 15, 16, 17]


def test_at_the_start_the_drafts_are_the_predictions_beginning():
    assert propose(PRED, [], (0, 0), 3) == ([10, 11, 12], (0, 0))


def test_an_output_that_keeps_to_the_prediction_is_followed_along():
    drafts, anchor = propose(PRED, [10, 11], (0, 0), 4)
    assert drafts == [12, 13, 14, 15] and anchor == (2, 2)
    assert propose(PRED, [10, 11, 12, 13, 14], anchor, 2) == ([15, 16], (5, 5))


def test_a_stray_output_is_re_anchored_on_its_longest_suffix_in_the_prediction():
    out = [10, 11, 99, 13, 14]  # strayed at 99, back on track at 13 14
    assert propose(PRED, out, (2, 2), 3) == ([15, 16, 17], (5, 5))
    assert propose(PRED, [10, 11, 99], (2, 2), 3) == ([], (2, 2))  # 99 occurs nowhere: no drafts


def test_drafts_stop_at_the_end_of_the_prediction_and_at_k():
    assert propose(PRED, PRED, (0, 0), 5) == ([], (8, 8))
    assert propose(PRED, PRED[:6], (0, 0), 0) == ([], (0, 0))
    assert propose([], [1], (0, 0), 4) == ([], (0, 0))


def test_a_repeated_ngram_prefers_the_occurrence_after_the_anchor():
    pred = [1, 2, 3, 7, 1, 2, 3, 8]
    drafts, anchor = propose(pred, [5, 1, 2, 3], (4, 1), 2)
    assert drafts == [8] and anchor == (7, 4)
