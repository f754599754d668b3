"""Turn rows of logits into next tokens: penalties, bias, min_tokens, temperature, top_p, seeded draws.

Controls are per row (most rows have none); the draw runs over the whole batch at once, and each seeded row takes
exactly one uniform number from its own generator per token, so its output does not depend on the batch.
"""

from __future__ import annotations

import torch

from waferscale.engine.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The sequence's own random generator (None for greedy): seeded from the request, or from the OS when
    unseeded. The global generator is never touched (torch.seed() would reseed it for everyone)."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is not None:
        generator.manual_seed(params.seed % 2**64)
    else:
        generator.seed()
    return generator


def apply_controls(
    row: torch.Tensor,
    params: SamplingParams,
    output_counts: dict[int, int],
    eos_ids: list[int],
    num_generated: int,
) -> None:
    """Frequency/presence penalties, logit_bias and the min_tokens EOS mask, applied to one row in place."""
    if output_counts and (params.frequency_penalty or params.presence_penalty):
        ids = torch.tensor(list(output_counts.keys()))
        counts = torch.tensor(list(output_counts.values()), dtype=row.dtype)
        row[ids] -= counts * params.frequency_penalty + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()))
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype)
    if num_generated < params.min_tokens and eos_ids:
        row[eos_ids] = float("-inf")


def needs_controls(params: SamplingParams, output_counts: dict[int, int], num_generated: int) -> bool:
    return bool(
        (output_counts and (params.frequency_penalty or params.presence_penalty))
        or params.logit_bias
        or num_generated < params.min_tokens
    )


def eos_mask_only(params: SamplingParams, output_counts: dict[int, int]) -> bool:
    """Whether this row's only control is min_tokens' EOS mask (no penalty that applies, no logit_bias)."""
    return not ((output_counts and (params.frequency_penalty or params.presence_penalty)) or params.logit_bias)


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    overrides: dict[int, torch.Tensor] | None = None,
    argmax: list[int] | None = None,
) -> list[int]:
    """One token per row: argmax for greedy rows (ties to the lowest id); otherwise temperature, nucleus (top_p)
    filter and an inverse-CDF draw with one uniform number from the row's generator.

    overrides replaces some rows (after apply_controls or a grammar mask); argmax, when the caller already has it, is
    each row's as drawn: of its override where it has one."""
    overrides = overrides or {}
    tokens = [0] * logits.shape[0]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    known = dict(enumerate(argmax)) if argmax is not None else {}
    plain = [i for i in greedy if i not in overrides and i not in known]
    if plain:
        rows = logits if len(plain) == len(params) else logits[plain]
        known.update(zip(plain, torch.argmax(rows, -1).tolist()))
    for i in greedy:
        tokens[i] = known[i] if i in known else int(torch.argmax(overrides[i]))
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    if any(i in overrides for i in sampled):
        chosen = torch.stack([overrides.get(i, logits[i]) for i in sampled])
    else:
        chosen = logits if len(sampled) == len(params) else logits[sampled]
    temps = torch.tensor([params[i].temperature for i in sampled], dtype=logits.dtype)
    scaled = chosen / temps[:, None]
    nucleus = [j for j, i in enumerate(sampled) if params[i].top_p < 1.0]
    if nucleus:
        top_p = torch.tensor([params[sampled[j]].top_p for j in nucleus], dtype=logits.dtype)
        sorted_logits, order = torch.sort(scaled[nucleus], dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits[drop] = float("-inf")
        scaled[nucleus] = torch.full_like(sorted_logits, float("-inf")).scatter(1, order, sorted_logits)
    cdf = scaled.softmax(-1).cumsum(-1)
    u = torch.tensor(
        [float(torch.rand(1, generator=params_gen)) for params_gen in (generators[i] for i in sampled)],
        dtype=cdf.dtype,
    )
    picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=cdf.shape[1] - 1)
    for i, t in zip(sampled, picks.squeeze(1).tolist()):
        tokens[i] = t
    return tokens


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the k most likely (id, logprob) pairs of one row."""
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top
