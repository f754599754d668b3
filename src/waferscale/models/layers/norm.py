"""RMSNorm as Llama computes it (weight times the normalised row, rounded to the input dtype first) and as Gemma
does (the row times 1 + weight, in float32, rounded last)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm; bf16 rows go through the native kernel where it was built."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.kernels = None  # waferscale.kernels.NativeKernels, for bf16 weights (process_weights_after_loading)

    def process_weights_after_loading(self, ctx) -> None:
        if ctx.kernels is not None and self.weight.dtype == torch.bfloat16:
            self.kernels = ctx.kernels

    @property
    def native(self) -> bool:
        """Whether bf16 rows are normalised by the native kernel (the whole-layer decode call needs it)."""
        return self.kernels is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            return self.kernels.rmsnorm_bf16(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Hugging Face's Gemma3RMSNorm: x / rms(x) * (1 + weight), computed in float32 and rounded once."""

    native = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
