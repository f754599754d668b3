"""The Llama family (llama, mistral, qwen2): pre-norm decoder layers of attention and a SiLU-gated MLP, with the
same numerics as Hugging Face's; a decode step can run each layer as one native call."""

from __future__ import annotations

import torch
from torch import nn

from waferscale.kernels import DecodeLayerWeights
from waferscale.models.base import CausalLM
from waferscale.models.config import ModelConfig
from waferscale.models.layers.attention import Attention, fused_decode_layer
from waferscale.models.layers.mlp import GatedMLP
from waferscale.models.layers.norm import RMSNorm
from waferscale.models.quant import ACT_MODE


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
        """The layer's weights for the whole-layer decode call, or None where a part of it is not native (each
        projection bf16 packed, gate/up in pairs, or quantized; plain attention; no output biases)."""
        attn, mlp = self.self_attn, self.mlp
        if not (attn.plain and self.input_layernorm.native and self.post_attention_layernorm.native):
            return None
        qkv, o, down = (p.method.decode_weight() for p in (attn.qkv_proj, attn.o_proj, mlp.down_proj))
        gate_up = mlp.decode_gate_up()
        if any(w is None for w in (qkv, o, gate_up, down)):
            return None
        if any(p.bias is not None for p in (attn.o_proj, mlp.down_proj, mlp.gate_up_proj)):
            return None
        return DecodeLayerWeights(
            norm1=self.input_layernorm.weight,
            qkv=qkv,
            qkv_bias=attn.qkv_proj.method.decode_bias(),
            o=o,
            norm2=self.post_attention_layernorm.weight,
            gate_up=gate_up,
            inter=mlp.inter,
            down=down,
            eps=self.input_layernorm.eps,
            act=ACT_MODE,
        )

    def decode_native(self, kv, index: int, h: torch.Tensor, rope, weights: DecodeLayerWeights) -> None:
        """This layer for decode rows in one native call, in place on h."""
        attn = self.self_attn
        fused_decode_layer(kv, index, h, rope, weights, attn.num_heads, attn.scale)


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, index)
