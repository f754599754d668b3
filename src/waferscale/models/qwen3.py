"""Qwen3 (dense): the Llama layer with a per-head RMSNorm on q and k before rope, no q/k/v bias, and head_dim
independent of hidden_size."""

from __future__ import annotations

from torch import nn

from waferscale.models.base import CausalLM
from waferscale.models.config import ModelConfig
from waferscale.models.layers.norm import RMSNorm
from waferscale.models.llama import LlamaDecoderLayer


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, index, qk_norm=RMSNorm)
