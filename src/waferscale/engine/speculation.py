"""Speculative decoding: who proposes a sequence's next tokens (n-gram lookup here, a draft model in
engine/draft_model.py), how many, and when not to.

N-gram (prompt lookup): a sequence's own prompt and output propose its next tokens.

Where the latest tokens occurred before (in a document being quoted, code being edited, a JSON being filled in), the
tokens that followed them then are proposed now, and verified in one forward as the rows of a predicted output are
(engine/output_processor.verify: each position sampled as usual, accepted while the sample equals the draft), so the
output is exactly what decoding without speculation gives. Per sequence, the number of drafts adapts to how many
were accepted, and a sequence whose drafts keep failing pauses for a growing number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAMS = (4, 3, 2)  # suffix lengths looked up, longest first
START_K = 4  # drafts proposed at first
METHODS = ("none", "ngram", "draft")
DECAY = 0.9  # weight of a sequence's earlier verifications in its acceptance estimate, one step on


class StepCosts:
    """What a decoding step costs by its rows (each sequence's last token and its drafts), measured on the steps the
    engine runs, and the number of drafts that pays for itself: where a row costs nearly as much as the step (row
    kernels bound by compute: Q4_0/Q4_1 without AMX tiles), a draft must be near certain to be worth its row."""

    def __init__(self, smoothing: float = 0.25, trusted_after: int = 2):
        self.smoothing = smoothing
        self.trusted_after = trusted_after  # steps of a size before its average counts (the first runs cold)
        self.samples: dict[int, int] = {}
        self.averages: dict[int, float] = {}  # rows -> moving average of a step's time

    def record(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows, all of them decoding or verifying drafts, took `seconds`."""
        n = self.samples.get(rows, 0)
        self.samples[rows] = n + 1
        old = self.averages.get(rows)
        warm = old is not None and n >= self.trusted_after
        self.averages[rows] = old + self.smoothing * (seconds - old) if warm else seconds

    def seconds(self, rows: int) -> float | None:
        """A step of `rows` rows' average time, once measured often enough to count."""
        return self.averages[rows] if self.samples.get(rows, 0) >= self.trusted_after else None

    def best_k(self, acceptance: float, most: int, rows: int) -> int:
        """The drafts (0..most) that give the most tokens a second for a sequence whose drafts are accepted with
        chance `acceptance` each (given the one before), added to a step of `rows` rows. A step size not measured
        yet counts as free, so that it gets measured."""
        base = self.seconds(rows)
        if base is None or base <= 0:
            return most
        best, best_rate, expected = 0, 1.0, 1.0
        for k in range(1, most + 1):
            expected += acceptance**k  # tokens a step gives: the sampled one, and each accepted draft in a row
            t = self.seconds(rows + k)
            rate = expected / (t / base) if t is not None else float("inf")
            if rate > best_rate:
                best, best_rate = k, rate
        return best


@dataclass
class AdaptiveK:
    """One sequence's draft count, adapted to how many of its drafts were accepted (every proposer's)."""

    k: int = START_K
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without speculation
    # drafts accepted, and verifications cut short by a rejection, both decaying (1 and 1: a prior of one in two)
    accepted: float = 1.0
    rejected: float = 1.0

    def acceptance(self) -> float:
        """The chance that a draft is accepted given the one before it was (its estimate from this sequence)."""
        return self.accepted / (self.accepted + self.rejected)

    def paused(self) -> bool:
        """Whether this step goes without drafts (counting the pause down)."""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def update(self, proposed: int, accepted: int, max_k: int) -> None:
        """Adapt the draft count to a verification's outcome: more after all were accepted, fewer after a miss,
        a pause of 2, 4, ... 32 steps after misses in a row."""
        if proposed == 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < proposed)
        if accepted == proposed:
            self.k, self.misses = min(max_k, self.k * 2), 0
        elif accepted:
            self.k, self.misses = max(1, accepted + 1), 0
        else:
            self.k = max(1, self.k // 2)
            self.misses += 1
            self.pause = min(32, 1 << self.misses)


@dataclass
class NgramState(AdaptiveK):
    """One sequence's n-gram index and its adaptive draft count."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest earlier occurrence
    indexed: int = 0  # n-grams ending at positions up to this one are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` found."""
        if self.paused():
            return []
        k = min(k, self.k)
        if k <= 0:
            return []
        end = len(tokens)
        for e in range(self.indexed + 1, end):  # index every n-gram ending before the current suffix's end
            for n in NGRAMS:
                if e >= n:
                    self.index[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in NGRAMS:
            if end < n:
                continue
            at = self.index.get(tuple(tokens[end - n :]))
            if at is not None:
                return tokens[at : at + k]
        return []


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative` and its limits: method (none, ngram or draft: a draft model's), the most drafts a step, and
    the most sequences decoding at once for which it still pays (beyond, a step is bound by compute, and drafts
    only add to it)."""

    method: str = "none"
    max_draft: int = 8
    max_seqs: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} (choose {', '.join(METHODS)})")
        if self.max_draft < 1:
            raise ValueError("the number of speculative tokens must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.method != "none"
