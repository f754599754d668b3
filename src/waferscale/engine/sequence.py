"""One sequence being generated: its tokens, parameters, random generator, KV blocks and output so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.errors import RequestError
from waferscale.engine.outputs import TokenLogprob
from waferscale.engine.params import SamplingParams


@dataclass(eq=False)  # identity: the scheduler keeps sequences in lists
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    matcher: Any = None  # llguidance.LLMatcher of a grammar-constrained sequence
    token_ids: list[int] = field(
        default_factory=list
    )  # prompt + every sampled token (what the KV cache holds)
    output_ids: list[int] = field(default_factory=list)  # sampled tokens returned to the client (no EOS)
    output_counts: dict[int, int] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # one block table per kind of layer (BlockManager.kinds); a window kind's entries that no window sees any more
    # are 0 (the null page), the first `dropped[kind]` of them
    block_tables: list[list[int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of the full blocks computed so far
    prompt_keys: list[bytes] | None = (
        None  # keys of every full block before the last token (set at admission)
    )
    num_computed: int = 0  # tokens whose keys/values are in the cache
    num_cached: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    prompt_logprobs_sent: bool = False
    num_generated: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    error: RequestError | None = None  # why it failed, when finish_reason is "error"
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    drafts: list[int] = field(
        default_factory=list
    )  # prediction tokens run in this step, verified when sampled
    prediction_anchor: tuple[int, int] = (0, 0)  # see prediction.propose
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    ngram: Any = None  # speculation.NgramState: its n-gram index and draft count, once it speculates
    draft: Any = None  # draft_model.DraftSeq: its draft model's KV blocks, proposal and draft count, once it has one

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    def fail(self, error: RequestError) -> None:
        self.finish_reason, self.error = "error", error

    @property
    def block_table(self) -> list[int]:
        """The first kind's table (the whole-context layers' where the model has any)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed
