"""The int8 KV cache's rounding (engine/kv_int8): a float32 scale per 64 channels of a vector (per vector where its
length is not a multiple of 64), symmetric, round to nearest even."""

from __future__ import annotations

import pytest
import torch

from waferscale.engine import kv_int8


def test_the_largest_magnitude_maps_to_127_and_sets_the_scale():
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0]])
    q, scale = kv_int8.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (1, 1)
    assert q.tolist() == [[32, -127, 64, 0]]  # 0.5 * 127 / 2 = 31.75
    assert scale.item() == pytest.approx(2.0 / 127)


def test_round_trip_error_is_at_most_half_a_step_per_value():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 64) * torch.logspace(-3, 2, 3)[None, :, None]  # heads of very different magnitudes
    q, scale = kv_int8.quantize(x)
    assert scale.shape == (4, 3, 1)
    err = (kv_int8.dequantize(q, scale) - x).abs()
    assert (err <= scale / 2 * (1 + 1e-6)).all()
    assert (err.amax(-1) > scale.squeeze(-1) / 8).all()  # and it is a real rounding, not a copy


def test_each_64_channels_of_a_wide_head_get_their_own_scale():
    x = torch.ones(2, 256)
    x[:, 70] = 100.0  # an outlier channel in the second group only
    q, scale = kv_int8.quantize(x)
    assert scale.shape == (2, 4) and kv_int8.num_scales(256) == 4
    assert torch.allclose(scale, torch.tensor([1 / 127, 100 / 127, 1 / 127, 1 / 127]).expand(2, 4))
    assert torch.equal(kv_int8.dequantize(q, scale)[:, :64], x[:, :64])  # the outlier costs its own group only


def test_a_head_not_a_multiple_of_64_wide_has_one_scale():
    assert kv_int8.num_scales(32) == kv_int8.num_scales(80) == 1 and kv_int8.num_scales(128) == 2
    _, scale = kv_int8.quantize(torch.randn(3, 80))
    assert scale.shape == (3, 1)


def test_halves_round_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5]])  # scale 1: the values are their own quotients
    q, _ = kv_int8.quantize(x)
    assert q.tolist() == [[127, 0, 2, 2, 0]]


def test_an_all_zero_vector_stays_zero():
    q, scale = kv_int8.quantize(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not q.any() and not scale.any()
    assert not kv_int8.dequantize(q, scale, torch.bfloat16).any()


def test_dequantize_returns_the_requested_dtype():
    q, scale = kv_int8.quantize(torch.randn(5, 16))
    out = kv_int8.dequantize(q, scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 16)
