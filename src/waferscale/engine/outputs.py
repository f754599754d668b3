"""What the engine hands back: per-sequence events carrying newly released text, tokens and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from waferscale.engine.errors import RequestError


@dataclass
class TokenLogprob:
    """One scored token: its text, log probability, alternatives and character offset in its text."""

    token_id: int
    text: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None = None  # the most likely alternatives: (token id, text, logprob)
    offset: int = 0


@dataclass
class GenerationEvent:
    """A delta for one sequence. The last one has `finished` set and the timings filled in."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: RequestError | None = (
        None  # set on a finished event of a request that failed (kind, message, param)
    )
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    cumulative_logprob: float = 0.0
    queue_time: float = 0.0
    prompt_time: float = 0.0
    completion_time: float = 0.0
    accepted_prediction_tokens: int = 0  # draft tokens of a predicted output that the model confirmed
    rejected_prediction_tokens: int = 0  # draft tokens proposed but not accepted
