"""int8 keys and values (--kv-cache-dtype int8): each token's vector of one KV head is stored as int8 with one
float32 scale, symmetric, round to nearest even of x / (amax / 127). The native kernels (cpu_kernels.c's
kv_quantize) round the same floats to the same bytes, so a fused decode and a PyTorch step store identical KV."""

from __future__ import annotations

import torch

QMAX = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], float32 scale [...]) with x ~ q * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector stays zero
    q = torch.round(x / divisor.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., D] with float32 scale [...] -> [..., D] in dtype (the product is taken in float32)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
