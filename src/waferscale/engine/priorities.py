"""How batch work and service tiers share the engine (the scheduler's priority policy): which running sequence
yields first, how many batch sequences run beside interactive ones, how many tokens of a step batch work takes, and
which waiting requests give up (the queue timeout; batch work waits within its own window)."""

from __future__ import annotations

import time
from collections import deque

from waferscale.engine.errors import ErrorKind, RequestError
from waferscale.engine.params import BATCH_PRIORITY
from waferscale.engine.sequence import Sequence

BATCH_BESIDE_INTERACTIVE = 4  # batch sequences that may run beside interactive ones (see _batch_room)
# Decode rows of batch work a step may carry beside interactive work: each row lengthens the step every interactive
# stream waits on. Only decode rows: one prefill row makes a step of decodes lose its fused whole-layer calls.
BATCH_TOKENS_BESIDE_INTERACTIVE = 2
# Beside interactive work, batch work prefills (and new batch sequences are admitted) in one step of this many,
# taking up to BATCH_STEP_TOKENS then: the batch moves on under endless interactive traffic, at one slow step in so
# many rather than a slower every step.
BATCH_PREFILL_EVERY = 64
# Tokens a step of batch work alone may carry: an interactive request that arrives waits for the step under way,
# and a step of a whole prefill budget is long; fewer tokens a step cost the batch throughput (docs/batch.md).
BATCH_STEP_TOKENS = 64


class PriorityPolicy:
    """The Scheduler's priority decisions, over its `running` and `waiting` lists (a mixin of Scheduler, whose
    `_fits` and `_preempt` it calls)."""

    running: list[Sequence]
    waiting: deque[Sequence]
    max_num_seqs: int
    queue_timeout: float | None
    num_timed_out: int

    _steps_beside = 0  # steps beside interactive work since batch work last could prefill

    def _batch_share(self, budget: int) -> tuple[int, bool]:
        """(Tokens of this step batch work may take, whether it may prefill and be admitted.)"""
        if not self._interactive():
            return min(budget, BATCH_STEP_TOKENS), True
        self._steps_beside += 1
        if self._steps_beside >= BATCH_PREFILL_EVERY:
            self._steps_beside = 0
            return min(budget, BATCH_STEP_TOKENS), True
        return BATCH_TOKENS_BESIDE_INTERACTIVE, False

    def _interactive(self) -> bool:
        """Whether interactive work runs or waits (batch work then yields most of each step to it)."""
        return any(s.params.priority < BATCH_PRIORITY and not s.finished for s in self.running) or (
            bool(self.waiting) and self.waiting[0].params.priority < BATCH_PRIORITY
        )

    def _batch_room(self) -> int:
        """How many more batch sequences may run now (negative: that many too many): any number while no interactive
        sequence runs or waits; beside interactive ones, BATCH_BESIDE_INTERACTIVE (the batch keeps going, narrower,
        and widens again when they are gone), sharing BATCH_TOKENS_BESIDE_INTERACTIVE tokens a step."""
        if not self._interactive():
            return self.max_num_seqs
        return BATCH_BESIDE_INTERACTIVE - sum(1 for s in self.running if s.params.priority >= BATCH_PRIORITY)

    def _victim(self) -> Sequence | None:
        """The running sequence to preempt first: the lowest priority, the newest among equals."""
        best, best_key = None, None
        for i, seq in enumerate(self.running):
            if seq.finished:
                continue
            key = (seq.params.priority, i)
            if best_key is None or key > best_key:
                best, best_key = seq, key
        return best

    def _yield_to_waiting(self) -> None:
        """While the first waiting sequence cannot be admitted (no slot or not enough blocks) and a running one has
        a lower priority, preempt that one: batch work gives its slot and blocks to an interactive request."""
        while self.waiting and self.running:
            head = self.waiting[0]
            victim = self._victim()
            if victim is None or victim.params.priority <= head.params.priority:
                return
            if len(self.running) < self.max_num_seqs and self._fits(head):
                break
            self._preempt(victim)
        self._narrow_batch()

    def _narrow_batch(self) -> None:
        """Beside interactive work, preempt the newest running batch sequences beyond BATCH_BESIDE_INTERACTIVE: every
        batch row in a step slows each interactive stream's next token. Their full blocks stay in the prefix cache,
        so resuming them later recomputes little."""
        excess = -self._batch_room()
        for seq in reversed(list(self.running)):
            if excess <= 0:
                return
            if seq.params.priority >= BATCH_PRIORITY and not seq.finished:
                self._preempt(seq)
                excess -= 1

    def _expire_waiting(self, ended: list[Sequence]) -> None:
        """End the requests that have waited for admission longer than the queue timeout (overloaded, never a hang)."""
        if self.queue_timeout is None or not self.waiting:
            return
        now = time.perf_counter()
        keep: deque[Sequence] = deque()
        for seq in self.waiting:
            batch = seq.params.priority >= BATCH_PRIORITY  # batch work waits within its own 24 h window
            if not batch and not seq.admitted_once and now - seq.arrival > self.queue_timeout:
                self.num_timed_out += 1
                message = (
                    f"the request waited {now - seq.arrival:.0f} s for a free slot (queue timeout "
                    f"{self.queue_timeout:g} s); the server is overloaded, retry later"
                )
                seq.fail(RequestError(ErrorKind.OVERLOADED, message))
                ended.append(seq)
            else:
                keep.append(seq)
        self.waiting = keep
