"""Turn one row of logits into the next token: penalties, bias, min_tokens, temperature, top_p, seeded draw."""

from __future__ import annotations

import torch

from waferscale.engine.params import SamplingParams


def apply_controls(
    logits: torch.Tensor,
    params: SamplingParams,
    output_counts: dict[int, int],
    eos_ids: list[int],
    num_generated: int,
) -> torch.Tensor:
    """Logits after frequency/presence penalties, logit_bias and the min_tokens EOS mask (a new tensor)."""
    out = logits.clone()
    if output_counts and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(list(output_counts.keys()))
        counts = torch.tensor(list(output_counts.values()), dtype=out.dtype)
        out[ids] -= counts * params.frequency_penalty + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()))
        out[ids] += torch.tensor(list(params.logit_bias.values()), dtype=out.dtype)
    if num_generated < params.min_tokens and eos_ids:
        out[eos_ids] = float("-inf")
    return out


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature, nucleus (top_p) filter and a draw from `generator`."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        sorted_logits[drop] = float("-inf")
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the k most likely (id, logprob) pairs of one row."""
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top
