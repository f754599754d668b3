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


@dataclass
class StepLoad:
    """A step's decoding rows and the tokens they are expected to give, as each sequence's drafts join it."""

    rows: int  # each decoding sequence's last token, and the drafts given so far
    tokens: float  # one a sequence, and the accepted drafts expected of those given

    def add(self, drafts: int, acceptance: float) -> None:
        self.rows += drafts
        self.tokens += sum(acceptance**j for j in range(1, drafts + 1))


@dataclass(frozen=True)
class RowCosts:
    """A decoding step's time by its rows (each sequence's last token, and drafts to verify after it)."""

    seconds: dict[int, float]

    def at(self, rows: int) -> float:
        """A step of `rows` rows' time: measured, between two sizes measured, or carried on from the last two."""
        if rows in self.seconds:
            return self.seconds[rows]
        sizes = sorted(self.seconds)
        if len(sizes) < 2:
            return self.seconds[sizes[-1]] * rows / sizes[-1]
        below = [r for r in sizes if r < rows]
        a = below[-1] if below and rows < sizes[-1] else sizes[-2]
        b = next(r for r in sizes if r > a)
        return self.seconds[a] + (rows - a) * (self.seconds[b] - self.seconds[a]) / (b - a)

    def best_k(self, acceptance: float, most: int, step: StepLoad) -> int:
        """The drafts (0..most) for a sequence whose drafts are each accepted with chance `acceptance` (given the one
        before) that give the step the most tokens a second, added to what it has so far."""
        base = self.at(step.rows)
        best, best_rate, expected = 0, step.tokens, step.tokens
        for k in range(1, most + 1):
            expected += acceptance**k  # each accepted draft in a row is a token more
            rate = expected * base / self.at(step.rows + k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def shared_k(self, wants: list[tuple[int, float]], step: StepLoad, per_forward: float) -> int:
        """The draft forwards (each making one more draft for every sequence that wants it; per_forward seconds each)
        that give the step the most tokens a second: wants holds each sequence's most drafts and acceptance, and a
        sequence gets the lesser of its most and the forwards."""
        base = self.at(step.rows)
        best, best_rate = 0, step.tokens
        for n in range(1, max((m for m, _ in wants), default=0) + 1):
            rows = step.rows + sum(min(n, m) for m, _ in wants)
            tokens = step.tokens + sum(a**j for m, a in wants for j in range(1, min(n, m) + 1))
            rate = tokens * base / (self.at(rows) + n * per_forward)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def describe(self) -> str:
        """The step's cost by rows against one row's, for the start-up log."""
        one = self.seconds[1]
        return ", ".join(f"{r}: {self.seconds[r] / one:.2f}x" for r in sorted(self.seconds))


@dataclass
class AdaptiveK:
    """One sequence's draft count, adapted to how many of its drafts were accepted (every proposer's)."""

    k: int = START_K
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without speculation
    # drafts accepted, and verifications cut short by a rejection, both decaying (1 and 1: a prior of one in two)
    accepted: float = 1.0
    rejected: float = 1.0
    idle: int = 0  # steps in a row whose costs gave no drafts
    wait: int = 2  # such steps before one draft is tried

    def acceptance(self) -> float:
        """The chance that a draft is accepted given the one before it was (its estimate from this sequence)."""
        return self.accepted / (self.accepted + self.rejected)

    def probe(self, paying: int, could_pay: bool) -> int:
        """The drafts to make given the count that pays at this sequence's estimate (`paying`): that count, or, where
        none has paid for a while but some would at the prior's acceptance (`could_pay`), one draft after 2, 4, ...
        32 such steps, so that an estimate lowered by a few misses can rise again (at most one draft in 32 steps
        where drafts keep missing; none where they could not pay even if accepted as the prior expects)."""
        if paying:
            self.idle, self.wait = 0, 2
            return paying
        if not could_pay:
            return 0
        self.idle += 1
        if self.idle < self.wait:
            return 0
        self.idle, self.wait = 0, min(32, self.wait * 2)
        return 1

    def paused(self) -> bool:
        """Whether this step goes without drafts (counting the pause down)."""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def update(self, proposed: int, accepted: int, max_k: int) -> None:
        """Adapt the draft count to a verification's outcome: more after all were accepted (and the next probe
        soon), fewer after a miss, a pause of 2, 4, ... 32 steps after misses in a row."""
        if proposed == 0:
            return
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (accepted < proposed)
        if accepted == proposed:
            self.k, self.misses, self.idle, self.wait = min(max_k, self.k * 2), 0, 0, 2
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
