"""Predicted outputs: draft tokens taken from the text a client expects, verified by the model in one forward.

Prompt-lookup style: find where the output so far continues the prediction, and propose the prediction tokens
that follow. A sequence remembers an anchor, (prediction index, output length): prediction[index:] is expected
to follow output[:length]. While the output keeps to the prediction, the anchor moves along with it; once it
strays, the longest recent suffix of the output (up to NGRAM tokens) that occurs in the prediction re-anchors it.
"""

from __future__ import annotations

MAX_DRAFT = 8  # draft tokens proposed per step (also bounded by the token budget, max_tokens and the context)
NGRAM = 3  # longest output suffix searched for in the prediction


def propose(
    prediction: list[int], output: list[int], anchor: tuple[int, int], k: int
) -> tuple[list[int], tuple[int, int]]:
    """Up to k draft tokens to follow `output`, and the anchor they were found at."""
    if k <= 0 or not prediction:
        return [], anchor
    index, length = anchor
    at = index + len(output) - length  # where the prediction continues if the output kept to it since
    if 0 <= at <= len(prediction) and length <= len(output) and _agrees(prediction, output, at):
        return prediction[at : at + k], (at, len(output))
    for n in range(min(NGRAM, len(output)), 0, -1):
        suffix = output[-n:]
        start = _find(prediction, suffix, max(0, index - n))
        if start is None:
            start = _find(prediction, suffix, 0)
        if start is not None:
            at = start + n
            return prediction[at : at + k], (at, len(output))
    return [], anchor


def _agrees(prediction: list[int], output: list[int], at: int) -> bool:
    """Whether the last output tokens (up to NGRAM) equal the prediction tokens just before `at`."""
    n = min(NGRAM, len(output), at)
    return output[len(output) - n :] == prediction[at - n : at] and (n > 0 or not output)


def _find(seq: list[int], sub: list[int], start: int) -> int | None:
    first, n = sub[0], len(sub)
    i = start
    while True:
        try:
            i = seq.index(first, i)
        except ValueError:
            return None
        if seq[i : i + n] == sub:
            return i
        i += 1
