"""int8 keys and values (--kv-cache-dtype int8): each token's vector of one KV head is stored as int8 with one
float32 scale per 64 channels (per head where head_dim is not a multiple of 64), symmetric, round to nearest even of
x / (amax / 127). The native kernels (cpu_kernels.c's kv_quantize, kv_group) round the same floats to the same
bytes, so a fused decode and a PyTorch step store identical KV."""

from __future__ import annotations

import torch

QMAX = 127
GROUP = 64  # channels a scale covers (cpu_kernels.c's KV_GROUP)


def group_size(head_dim: int) -> int:
    """Channels per scale: 64 where head_dim is a multiple of it, else the whole head."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def num_scales(head_dim: int) -> int:
    """Scales per token and head."""
    return head_dim // group_size(head_dim)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], float32 scales [..., num_scales(D)]) with x ~ q * scale."""
    d = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], num_scales(d), group_size(d))
    scale = groups.abs().amax(dim=-1) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    q = torch.round(groups / divisor.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., D] with float32 scales [..., num_scales(D)] -> [..., D] in dtype (the product taken in float32)."""
    groups = q.float().reshape(*scale.shape, -1) * scale.unsqueeze(-1)
    return groups.reshape(q.shape).to(dtype)
