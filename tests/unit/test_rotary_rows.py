"""Rope's cos/sin rows, no model: a single stream's decode step reads its row from a chunk computed once, and that
row is the one a step of several positions computes for the same position, bit for bit (what speculation's
exactness and batch invariance rely on)."""

from __future__ import annotations

import pytest
import torch

from waferscale.models.layers.rotary import _CHUNK, _CHUNKS_KEPT, Rotary

SCALINGS = {
    "plain": None,
    "llama3": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    # yarn scales cos/sin by its attention factor (scale != 1)
    "yarn": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_single_position_gets_the_row_a_step_of_many_positions_computes(scaling, dtype):
    rope = Rotary(64, 500000.0, SCALINGS[scaling], 131072, dtype)
    positions = torch.tensor([0, 1, 5, 255, 256, 257, 1000, 4095, 70001])
    cos_all, sin_all = rope(positions)
    for i, p in enumerate(positions.tolist()):
        cos, sin = rope(torch.tensor([p]))
        assert cos.shape == (1, 1, 64) and cos.dtype == dtype
        assert torch.equal(cos, cos_all[i : i + 1]) and torch.equal(sin, sin_all[i : i + 1]), p


def test_the_chunks_kept_stay_bounded():
    rope = Rotary(64, 10000.0, None, 1 << 20, torch.bfloat16)
    for p in range(0, 40 * _CHUNK, _CHUNK // 2):
        rope(torch.tensor([p]))
    assert len(rope._chunks) == _CHUNKS_KEPT
    assert max(rope._chunks) == 39  # the latest positions' chunk is among those kept


def test_a_cast_computes_the_chunks_again():
    rope = Rotary(64, 10000.0, None, 4096, torch.float32)
    rope(torch.tensor([300]))
    rope.double()  # inv_freq now float64: the rows computed before the cast are not served after it
    cos, sin = rope(torch.tensor([300]))
    cos_all, sin_all = rope(torch.tensor([299, 300]))
    assert torch.equal(cos, cos_all[1:]) and torch.equal(sin, sin_all[1:])
