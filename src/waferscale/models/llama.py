"""The Llama family (llama, mistral, qwen2): pre-norm decoder layers of attention and a SiLU-gated MLP, with the
same numerics as Hugging Face's; a decode step can run each layer as one native call."""

from __future__ import annotations

import torch
from torch import nn

from waferscale.kernels import DecodeLayerWeights
from waferscale.models.base import CausalLM, layer_decode_weights
from waferscale.models.config import ModelConfig
from waferscale.models.layers.attention import Attention, fused_decode_layer
from waferscale.models.layers.mlp import GatedMLP
from waferscale.models.layers.norm import RMSNorm


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); the residual adds run inside the projections' kernels."""

    def __init__(
        self, cfg: ModelConfig, index: int, qk_norm: type[nn.Module] | None = None, mlp: nn.Module | None = None
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            window=cfg.window(index),
            qk_norm=qk_norm,
            norm_eps=cfg.rms_norm_eps,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, h: torch.Tensor, rope, kv, index: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(h), rope, kv, index, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def decode_weights(self) -> DecodeLayerWeights | None:
        """The layer's weights for the whole-layer decode call, or None where a part of it is not native."""
        return layer_decode_weights(self, (self.input_layernorm, self.post_attention_layernorm))

    def decode_native(self, kv, index: int, h: torch.Tensor, rope, weights: DecodeLayerWeights) -> None:
        """This layer for decode rows in one native call, in place on h."""
        fused_decode_layer(kv, index, h, rope, weights, self.self_attn)


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, index)
