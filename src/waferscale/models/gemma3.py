"""Gemma 3 (text): sliding-window and global layers interleaved, each with its own rope base; q/k norms; four
norms a layer (input, post-attention, pre- and post-feed-forward), all scaled by 1 + w; tanh-GELU gated MLP;
embeddings times sqrt(hidden_size); attention scaled by query_pre_attn_scalar^-1/2; optional logit soft-capping."""

from __future__ import annotations

import torch
from torch import nn

from waferscale.kernels import DecodeLayerWeights
from waferscale.models.base import CausalLM, layer_decode_weights
from waferscale.models.config import ModelConfig
from waferscale.models.layers.attention import Attention, fused_decode_layer
from waferscale.models.layers.mlp import GatedMLP
from waferscale.models.layers.norm import GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            scale=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
            window=cfg.window(index),
            qk_norm=GemmaRMSNorm,
            norm_eps=eps,
        )
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, h: torch.Tensor, rope, kv, index: int) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, kv, index))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def decode_weights(self) -> DecodeLayerWeights | None:
        """The layer's weights for the whole-layer decode call (Gemma's norms, q/k norms, sandwich norms, GELU), or
        None where a part of it is not native."""
        return layer_decode_weights(
            self,
            (self.input_layernorm, self.pre_feedforward_layernorm),
            (self.post_attention_layernorm, self.post_feedforward_layernorm),
        )

    def decode_native(self, kv, index: int, h: torch.Tensor, rope, weights: DecodeLayerWeights) -> None:
        """This layer for decode rows in one native call, in place on h."""
        fused_decode_layer(kv, index, h, rope, weights, self.self_attn)


class Gemma3ForCausalLM(CausalLM):
    norm_class = GemmaRMSNorm

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, index)
