"""Which sequences run in the next forward, and how much of each: plain Python over a BlockManager, no model.

Each step takes one token of every decoding sequence, then chunks of prefilling ones, then admits waiting
sequences while the token budget, the batch size and the free blocks allow. When the pool runs out, the newest
sequence of the lowest priority is preempted (its blocks freed) and recomputed later; its client still gets the whole
answer. Layers with a sliding window have blocks of their own kind (BlockManager.kinds): a sequence gets them for
each chunk as it runs, and gives back those its window can no longer see before each step, so a long sequence holds
window-layer KV for its window only (plus a chunk; the page arithmetic is in page_plan.py). The waiting queue is ordered by priority (SamplingParams.priority, lower first), then arrival: a waiting
sequence of a higher priority is admitted before any lower one, and takes the slot and blocks of running sequences
of a lower priority (batch work) when there are none free.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from waferscale.engine.block_manager import BlockManager, PrefixHit
from waferscale.engine.drafts import draft_tokens
from waferscale.engine.errors import ErrorKind, RequestError
from waferscale.engine.page_plan import PagePlan
from waferscale.engine.params import BATCH_PRIORITY
from waferscale.engine.prefix_sharing import PrefixSharing
from waferscale.engine.priorities import PriorityPolicy
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import RowCosts, SpeculativeConfig, StepLoad


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one token each
    prefills: list[tuple[Sequence, int]] = field(
        default_factory=list
    )  # a chunk of prompt (or recompute) each
    ended: list[Sequence] = field(
        default_factory=list
    )  # finished without running: refused, expired or max_tokens=0

    @property
    def seqs(self) -> list[Sequence]:
        return self.decodes + [s for s, _ in self.prefills]


class Scheduler(PriorityPolicy, PrefixSharing):
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        queue_timeout: float | None = None,
        max_model_len: int = 1 << 30,
        speculative: SpeculativeConfig | None = None,
    ):
        self.blocks = blocks
        self.kinds = blocks.kinds
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, 1)
        self.queue_timeout = queue_timeout  # seconds a request may wait for its first admission
        self.max_model_len = max_model_len
        self.speculative = speculative or SpeculativeConfig()
        self.row_costs: RowCosts | None = None  # decoding steps' times by rows (set at start), which cap own drafts
        self.pages = PagePlan(blocks, self.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_timed_out = 0

    def add(self, seq: Sequence) -> None:
        """Queue seq after every waiting sequence of its priority or a higher one."""
        self._insert(seq, after_equal=True)

    def _insert(self, seq: Sequence, *, after_equal: bool) -> None:
        """Into the waiting queue at seq's priority: behind its equals (a new arrival) or ahead of them (a
        preempted sequence, which resumes first)."""
        p = seq.params.priority
        if (
            not self.waiting
            or self.waiting[-1].params.priority < p
            or (after_equal and self.waiting[-1].params.priority == p)
        ):
            self.waiting.append(seq)
            return
        for i, other in enumerate(self.waiting):
            if other.params.priority > p or (not after_equal and other.params.priority == p):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, request_id: str) -> None:
        """Forget a sequence and free its blocks."""
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.free(seq)
        self.running = [s for s in self.running if s.request_id != request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)

    def take_all(self) -> list[Sequence]:
        """Remove every sequence (running and waiting), its blocks freed."""
        seqs = self.running + list(self.waiting)
        for seq in seqs:
            self.free(seq)
        self.running, self.waiting = [], deque()
        return seqs

    def retire(self) -> None:
        """Drop finished sequences from the running list (their blocks were freed when they finished)."""
        self.running = [s for s in self.running if not s.finished]

    def free(self, seq: Sequence) -> None:
        for table in seq.block_tables:
            self.blocks.release(table)
        seq.block_tables, seq.dropped, seq.block_keys = [], [], []

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        taken: set[int] = set()
        for seq in self.running:
            self.pages.drop_out_of_window(seq)
        self._yield_to_waiting()
        decoding = [s for s in self.running if not s.finished and s.remaining == 1 and s.num_generated]
        speculate = self.speculative.enabled and len(decoding) <= self.speculative.max_seqs
        load = StepLoad(len(decoding), len(decoding))  # the rows and tokens the own drafts weigh their cost against
        batch_left, batch_prefills = self._batch_share(budget)

        def room(seq: Sequence, want: int) -> int:
            """Tokens seq may take of this step: the step's budget, and the batch share for batch work."""
            return (
                min(want, budget, batch_left) if seq.params.priority >= BATCH_PRIORITY else min(want, budget)
            )

        def took(seq: Sequence, n: int) -> None:
            nonlocal budget, batch_left
            budget -= n
            if seq.params.priority >= BATCH_PRIORITY:
                batch_left -= n

        # by priority, oldest first among equals: a sequence preempted for room (the lowest priority, the newest)
        # is then never one already scheduled in this step
        for seq in sorted(self.running, key=lambda s: s.params.priority):
            if seq.finished or seq.remaining != 1 or not seq.num_generated or room(seq, 1) <= 0:
                continue
            if seq not in self.running:  # preempted while making room for an older sequence
                continue
            left = room(seq, budget) - 1
            drafts = draft_tokens(seq, left, self.max_model_len, self.speculative, speculate, self.row_costs, load)
            if not self._ensure_blocks(seq, len(seq.token_ids) + len(drafts), taken):
                continue  # seq itself was preempted, or waits for room
            taken.add(id(seq))
            if drafts:  # the last token and the drafts run as one chunk over the cached prefix
                seq.drafts = drafts
                out.prefills.append((seq, 1 + len(drafts)))
                took(seq, 1 + len(drafts))
                continue
            out.decodes.append(seq)
            took(seq, 1)
        # prefills of running sequences, by priority; those below the best waiting one prefill only with what
        # admitting it leaves
        head = self.waiting[0].params.priority if self.waiting else BATCH_PRIORITY + 1
        later: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.params.priority):
            if id(seq) in taken or seq.finished or seq.remaining <= 0 or budget <= 0:
                continue
            if seq.params.priority > head:
                later.append(seq)
                continue
            if seq.params.priority >= BATCH_PRIORITY and not batch_prefills:
                continue
            chunk = room(seq, seq.remaining)
            if chunk <= 0 or seq not in self.running:
                continue
            if not self._ensure_blocks(seq, seq.num_computed + chunk, taken):
                continue
            taken.add(id(seq))
            out.prefills.append((seq, chunk))
            took(seq, chunk)
        self._expire_waiting(out.ended)
        in_flight = self._prefix_keys_in_flight()
        deferred: list[Sequence] = []
        batch_room = self._batch_room()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.params.priority >= BATCH_PRIORITY:
                if batch_room <= 0 or room(seq, 1) <= 0 or not batch_prefills:
                    break  # the queue is ordered: only batch work is left, and it waits
                batch_room -= 1
            if self._shares_prefix_in_flight(seq, in_flight):
                deferred.append(self.waiting.popleft())  # admitted once those blocks are cached
                continue
            if not self._admit(seq, room(seq, budget)):
                break
            self.waiting.popleft()
            if seq.finished:
                out.ended.append(seq)
                continue
            in_flight.update(seq.prompt_keys[len(seq.block_keys) :])
            self.running.append(seq)
            taken.add(id(seq))
            chunk = room(seq, seq.remaining)
            out.prefills.append((seq, chunk))
            took(seq, chunk)
        self.waiting.extendleft(reversed(deferred))
        for seq in later:
            chunk = room(seq, seq.remaining)
            if chunk <= 0 or seq not in self.running or (seq.params.priority >= BATCH_PRIORITY and not batch_prefills):
                continue
            if not self._ensure_blocks(seq, seq.num_computed + chunk, taken):
                continue
            taken.add(id(seq))
            out.prefills.append((seq, chunk))
            took(seq, chunk)
        return out

    def _fits(self, seq: Sequence) -> bool:
        """Whether the pool could give seq its blocks now."""
        hit = self._hit(seq)
        return self.blocks.can_allocate(
            self._admission_pages(seq, hit, self.max_num_batched_tokens), hit.reused
        )

    def _hit(self, seq: Sequence) -> PrefixHit:
        """The cached prefix seq can start from (none when it wants its prompt's logprobs, which need every row)."""
        if seq.params.prompt_logprobs:
            return PrefixHit(0, [[] for _ in self.kinds])
        return self.blocks.hit(self._prompt_keys(seq), seq.token_ids)

    def _admission_pages(self, seq: Sequence, hit: PrefixHit, budget: int) -> int:
        """New pages seq needs to be admitted from `hit` and run its first chunk (at most `budget` tokens)."""
        return self.pages.admission_pages(
            len(seq.token_ids), hit.blocks * self.block_size, hit.tables, budget
        )

    def sequence_pages(self, num_tokens: int) -> int:
        return self.pages.sequence_pages(num_tokens)

    def window_blocks(self, window: int) -> int:
        return self.pages.window_blocks(window)

    def capacity_tokens(self) -> int | None:
        return self.pages.capacity_tokens()

    def settle_drafts(self, seq: Sequence) -> None:
        """After verification: only the accepted drafts' keys and values count (the rest are overwritten later)."""
        seq.num_computed = min(seq.num_computed, len(seq.token_ids) - 1)
        seq.drafts = []

    def computed(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens are in the cache; full blocks join the prefix cache."""
        for seq in batch.decodes:
            seq.num_computed += 1
        for seq, chunk in batch.prefills:
            seq.num_computed += chunk
        for seq in batch.seqs:
            self.register_full_blocks(seq)

    def register_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        full = min(seq.num_computed, len(seq.token_ids)) // bs
        if full > len(seq.block_keys):
            parent = seq.block_keys[-1] if seq.block_keys else None
            start = len(seq.block_keys) * bs
            new = self.blocks.block_keys(seq.token_ids[start : full * bs], parent)
            for i, key in enumerate(new):
                first = start + i * bs
                for table in seq.block_tables:
                    block = table[len(seq.block_keys) + i]
                    if block:
                        self.blocks.register(block, key, seq.token_ids[first : first + bs])
            seq.block_keys += new

    # ------------------------------------------------------------------ admission
    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give a waiting sequence its blocks (reusing cached prefix blocks) for its prompt and first chunk (at most
        `budget` tokens); False if the pool cannot yet.

        A sequence that can never be served, or needs no forward, comes back finished (True)."""
        if seq.params.max_tokens == 0 and not seq.params.prompt_logprobs:
            seq.scheduled_at = time.perf_counter()
            seq.finish_reason = "length"
            return True
        tokens = seq.token_ids
        # the last token is always computed (its logits are needed), so only blocks before it may come from cache
        keys = self._prompt_keys(seq)
        hit = self._hit(seq)
        needed = self._admission_pages(seq, hit, budget)
        if self.sequence_pages(len(tokens)) > self.blocks.num_blocks - 1 or (
            not self.running and not self.blocks.can_allocate(needed, hit.reused)
        ):
            longest = self.capacity_tokens()
            message = (
                f"the sequence needs {len(tokens)} tokens of KV cache; this server's cache holds {longest}: send a "
                "shorter prompt"
                if longest
                else "this server's KV cache is too small for one sliding window and chunk: raise --kv-cache-memory"
            )
            seq.fail(RequestError(ErrorKind.INVALID_REQUEST, message, "prompt"))
            return True
        if not self.blocks.can_allocate(needed, hit.reused):
            return False
        self.pages.start(seq, hit)
        seq.block_keys = keys[: hit.blocks]
        end = seq.num_computed + min(seq.remaining, budget)
        self.pages.grow(seq, self.pages.targets(len(tokens), end))
        if not seq.admitted_once:
            if not seq.params.prompt_logprobs:
                self.blocks.count_lookup(len(keys), hit.blocks)
            seq.num_cached = seq.num_computed
            seq.scheduled_at = time.perf_counter()
            seq.admitted_once = True
        return True

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, taken: set[int]) -> bool:
        """Make room for `num_tokens` in seq's tables, preempting the newest sequences not yet scheduled in this step
        if needed; False if seq was preempted itself or must wait (the only candidates are already scheduled)."""
        targets = self.pages.targets(num_tokens, num_tokens)
        while True:
            if self.pages.missing_pages(targets, seq.block_tables) <= self.blocks.num_available:
                break
            victim = self._victim()
            if victim is None or (victim is not seq and id(victim) in taken):
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.pages.grow(seq, targets)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.free(seq)
        seq.num_computed = 0
        self.running.remove(seq)
        self._insert(seq, after_equal=False)
        self.num_preemptions += 1
