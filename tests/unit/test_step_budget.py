"""The default token budget of a forward step, from a model's routing (no model)."""

from __future__ import annotations

from waferscale.engine.step_budget import default_step_tokens


def test_a_dense_model_steps_512_tokens_by_default():
    assert default_step_tokens() == 512


def test_a_mixture_of_experts_steps_enough_tokens_for_64_rows_an_expert():
    assert default_step_tokens(128, 8) == 1024  # Qwen3-30B-A3B, Qwen3-235B-A22B
    assert default_step_tokens(32, 4) == 512  # gpt-oss-20b: 512 x 4 / 32 = 64 already
    assert default_step_tokens(8, 2) == 512  # never under the dense budget


def test_a_mixture_of_experts_steps_at_most_2048_tokens_by_default():
    assert default_step_tokens(128, 4) == 2048  # gpt-oss-120b
    assert default_step_tokens(512, 10) == 2048  # Qwen3-Next's 512 experts, 10 a token
