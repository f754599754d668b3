"""One sequence being generated: its prompt, parameters, random generator, KV cache and output so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.kv_cache import SequenceKVCache
from waferscale.engine.outputs import TokenLogprob
from waferscale.engine.params import SamplingParams


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    kv: SequenceKVCache
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_counts: dict[int, int] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_generated: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    prefilled: bool = False
    last_token: int = -1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
