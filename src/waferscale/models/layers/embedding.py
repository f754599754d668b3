"""Token embeddings: a float table, or quantized blocks of which only the looked-up rows are dequantized."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.models.quant import QuantEmbedding, QuantWeight


class Embedding(nn.Module):
    """Token ids to rows of the table, times `scale` (Gemma multiplies by sqrt(hidden_size) in the table's dtype)."""

    def __init__(self, num: int, dim: int, scale: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)
        self.scale = scale
        self.quant: QuantEmbedding | None = None

    def load(self, value: torch.Tensor | QuantWeight, dtype: torch.dtype) -> None:
        if isinstance(value, QuantWeight):
            self.quant = QuantEmbedding(value, dtype)
            self.weight = None  # the blocks are the only copy
            return
        expected = tuple(self.weight.shape)
        if tuple(value.shape) != expected:
            raise ValueError(f"tensor 'model.embed_tokens.weight' has shape {tuple(value.shape)}, expected {expected}")
        self.weight = nn.Parameter(value.contiguous(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.quant(ids) if self.quant is not None else F.embedding(ids, self.weight)
        if self.scale is not None:
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        return h
