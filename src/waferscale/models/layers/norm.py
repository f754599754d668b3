"""RMSNorm as Llama computes it (weight times the normalised row, rounded to the input dtype first) and as Gemma
does (the row times 1 + weight, in float32, rounded last)."""

from __future__ import annotations

import torch
from torch import nn

from waferscale.kernels import NORM_GEMMA, NORM_LLAMA


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

    kind = NORM_LLAMA  # how the whole-layer decode call applies it

    def decode_weight(self) -> torch.Tensor:
        """The weight as the whole-layer decode call reads it (bf16)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16:  # rows of any shape (per-head q/k norms too)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.kernels.rmsnorm_bf16(rows, self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Hugging Face's Gemma3RMSNorm: x / rms(x) * (1 + weight), computed in float32 and rounded once; bf16 rows go
    through the native kernel where it was built (1 + weight kept in float32 for it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.kernels = None
        self.plus_one: torch.Tensor | None = None  # float32 1 + weight, for the native kernel

    def process_weights_after_loading(self, ctx) -> None:
        if ctx.kernels is not None and self.weight.dtype == torch.bfloat16:
            self.kernels = ctx.kernels
            self.plus_one = (1.0 + self.weight.float()).contiguous()

    @property
    def native(self) -> bool:
        """Whether bf16 rows are normalised by the native kernel (the whole-layer decode call needs it)."""
        return self.kernels is not None

    kind = NORM_GEMMA

    def decode_weight(self) -> torch.Tensor:
        """The weight as the whole-layer decode call reads it (float32 1 + weight)."""
        return self.plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.kernels.rmsnorm_gemma_bf16(rows, self.plus_one, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
