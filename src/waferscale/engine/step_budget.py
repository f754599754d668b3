"""A forward step's default token budget (--max-num-batched-tokens unset), from the model's routing."""

from __future__ import annotations

DENSE_STEP_TOKENS = 512
EXPERT_ROWS_A_STEP = 64
MOST_STEP_TOKENS = 2048


def default_step_tokens(num_experts: int = 0, experts_per_token: int = 0) -> int:
    """A forward step's default token budget: 512, or for a mixture of experts enough tokens that a full prefill
    step gives each expert 64 rows on average (tokens x k / E; a power of two, at most 2048), since each step reads
    every expert a step's rows touch and an expert's GEMM on a few rows is slower a row (docs/models.md)."""
    if num_experts <= 0 or experts_per_token <= 0:
        return DENSE_STEP_TOKENS
    tokens = -(-EXPERT_ROWS_A_STEP * num_experts // experts_per_token)
    return min(max(DENSE_STEP_TOKENS, 1 << (tokens - 1).bit_length()), MOST_STEP_TOKENS)
