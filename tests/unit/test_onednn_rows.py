"""Where oneDNN multiplies bf16 (AVX512-BF16, AMX), batches are padded to a few row counts: its caches keep a
primitive per shape, and continuous batching would otherwise bring a new shape at almost every step."""

from __future__ import annotations

import torch

from waferscale.models.layers import linear
from waferscale.models.layers.linear import Linear, LoadContext, onednn_rows


def test_any_batch_from_1_to_8192_rows_meets_a_few_shapes():
    shapes = {onednn_rows(r) for r in range(1, 8193)}
    assert len(shapes) <= 8 + 128
    assert all(onednn_rows(r) >= r for r in range(1, 8193))
    assert all(onednn_rows(r) - r < max(16, r // 2) for r in range(1, 8193))


def test_a_padded_batch_gives_each_row_what_it_gets_unpadded(monkeypatch):
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True)
    lin.weight.data = torch.randn(48, 64).bfloat16()
    lin.bias.data = torch.randn(48).bfloat16()
    lin.process_weights_after_loading(LoadContext(torch.bfloat16, kernels=None, hardware_bf16=True))
    calls = []
    real = linear.F.linear
    monkeypatch.setattr(linear.F, "linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    x = torch.randn(17, 64).bfloat16()
    y = lin(x)
    assert calls == [32] and y.shape == (17, 48)
    torch.testing.assert_close(y, real(x, lin.weight, lin.bias), rtol=0.02, atol=0.02)
