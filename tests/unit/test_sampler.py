"""Sampling controls on fixed logits: greedy, temperature, top_p, penalties, bias, min_tokens, seeds."""

from __future__ import annotations

import torch

from waferscale.engine import sampler
from waferscale.engine.params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 3.0, 0.5, -1.0]])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_and_ties_go_to_the_lowest_id():
    assert sampler.draw(LOGITS, [SamplingParams(4, temperature=0)], [None]) == [1]


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    params = SamplingParams(4, temperature=1.0, top_p=1e-6)
    assert {sampler.draw(logits, [params], [gen(s)])[0] for s in range(20)} == {1}


def test_a_seeded_draw_repeats_and_does_not_depend_on_its_batch():
    p = SamplingParams(4, temperature=1.0, seed=5)
    alone = [sampler.draw(LOGITS, [p], [gen(5)])[0] for _ in range(3)]
    logits = torch.cat([torch.randn(1, 5), LOGITS])
    batched = [sampler.draw(logits, [SamplingParams(4, temperature=0.7), p], [gen(1), gen(5)])[1] for _ in range(3)]
    assert alone == batched


def test_high_temperature_spreads_draws_over_the_vocabulary():
    p = SamplingParams(4, temperature=50.0)
    g = gen(0)
    assert len({sampler.draw(LOGITS, [p], [g])[0] for _ in range(200)}) == 5


def test_logit_bias_and_penalties_move_the_argmax():
    row = LOGITS[0].clone()
    sampler.apply_controls(row, SamplingParams(4, temperature=0, logit_bias={4: 10.0}), {}, [], 0)
    assert int(row.argmax()) == 4
    row = LOGITS[0].clone()
    sampler.apply_controls(row, SamplingParams(4, frequency_penalty=1.0, presence_penalty=0.5), {1: 2}, [], 2)
    assert row[1].item() == 3.0 - 2 * 1.0 - 0.5 and int(row.argmax()) == 2


def test_min_tokens_masks_eos_until_reached():
    p = SamplingParams(4, temperature=0, min_tokens=2)
    assert sampler.needs_controls(p, {}, 1) and not sampler.needs_controls(p, {}, 2)
    row = LOGITS[0].clone()
    sampler.apply_controls(row, p, {}, [1, 2], 1)
    assert row[1] == float("-inf") and row[2] == float("-inf")
    assert sampler.draw(LOGITS, [p], [None], overrides={0: row}) == [0]


def test_generators_are_per_request_and_the_global_one_is_never_reseeded():
    assert sampler.make_generator(SamplingParams(4, temperature=0)) is None
    torch.manual_seed(1234)
    before = torch.initial_seed()
    expected = torch.rand(3)
    torch.manual_seed(1234)
    unseeded = sampler.make_generator(SamplingParams(4, temperature=1.0))
    assert torch.initial_seed() == before and torch.equal(torch.rand(3), expected)
    a = sampler.make_generator(SamplingParams(4, temperature=1.0, seed=7))
    b = sampler.make_generator(SamplingParams(4, temperature=1.0, seed=7))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert unseeded.initial_seed() != a.initial_seed()


def test_token_logprobs_of_a_row():
    lp = torch.log_softmax(LOGITS[0], -1)
    chosen, top = sampler.token_logprobs(lp, 3, 2)
    assert chosen == float(lp[3]) and [t for t, _ in top] == [1, 2]
