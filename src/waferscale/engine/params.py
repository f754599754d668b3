"""Sampling parameters of one sequence, already resolved against the model (no nulls, no -1 sentinels)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Scheduling priorities, lower first: the service tiers of interactive requests, then batch work below them all.
TIER_PRIORITY = {"priority": 0, "default": 1, "flex": 2}
BATCH_PRIORITY = 3


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; 0: sampled token only; k: plus the k most likely
    prompt_logprobs: bool = False  # echo with logprobs: score every prompt token
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None  # a grammar_root name: constrain the output to that built-in grammar
    lark: str | None = None  # or a whole Lark grammar (llguidance dialect): chat's tools and response formats
    prediction: list[int] | None = (
        None  # token ids of the output the client expects: drafts verified in one forward
    )
    skip_special_tokens: bool = True  # False keeps special tokens in the text (harmony's channel markers)

    priority: int = TIER_PRIORITY["default"]  # admitted before any waiting sequence of a larger number

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by them would overflow."""
        return self.temperature < 1e-5
