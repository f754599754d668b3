"""Prompt blocks that another sequence is computing right now (the scheduler's prefix sharing): a sequence whose next
block is in flight waits a step or two and takes it from the prefix cache instead of computing it twice."""

from __future__ import annotations

from waferscale.engine.block_manager import BlockManager
from waferscale.engine.sequence import Sequence


class PrefixSharing:
    """A mixin of Scheduler, over its `running` sequences and its block manager."""

    running: list[Sequence]
    blocks: BlockManager
    block_size: int

    def _prefix_keys_in_flight(self) -> set[bytes]:
        """Keys of full prompt blocks that running sequences are still prefilling."""
        if not self.blocks.enable_prefix_cache:
            return set()
        return {k for s in self.running for k in s.prompt_keys[len(s.block_keys) :]}

    def _shares_prefix_in_flight(self, seq: Sequence, in_flight: set[bytes]) -> bool:
        """Whether seq's next uncached prompt block is being computed right now by another sequence (the other
        choices of an `n`/`best_of` request, or a concurrent request with the same prompt): better to wait a step
        or two and take it from the cache than to compute it twice."""
        if not in_flight or seq.params.prompt_logprobs:
            return False
        keys = self._prompt_keys(seq)
        cached = self.blocks.hit(keys, seq.token_ids).blocks
        return cached < len(keys) and keys[cached] in in_flight

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of seq's full blocks before its last token, computed once per token count (a preempted sequence
        has grown since)."""
        if seq.prompt_keys is None or len(seq.prompt_keys) != (len(seq.token_ids) - 1) // self.block_size:
            seq.prompt_keys = self.blocks.block_keys(seq.token_ids[:-1])
        return seq.prompt_keys
