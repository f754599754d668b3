"""Qwen3-MoE: Qwen3's attention layer with a mixture of experts for its feed-forward (softmax over the experts,
the top k, renormalised where norm_topk_prob says); layers listed in mlp_only_layers keep a dense MLP."""

from __future__ import annotations

from torch import nn

from waferscale.models.base import CausalLM
from waferscale.models.config import ModelConfig
from waferscale.models.layers.moe import SOFTMAX_TOPK, Routing, SparseMoE
from waferscale.models.layers.norm import RMSNorm
from waferscale.models.llama import LlamaDecoderLayer


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """x + attn(norm(x)), then + moe(norm(x)) (or + mlp(norm(x)) in a dense layer)."""

    def __init__(self, cfg: ModelConfig, index: int):
        moe = None
        if cfg.is_moe(index):
            routing = Routing(cfg.num_experts_per_tok, SOFTMAX_TOPK, cfg.norm_topk_prob)
            moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, routing, cfg.hidden_act)
        super().__init__(cfg, index, qk_norm=RMSNorm, mlp=moe)


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return Qwen3MoeDecoderLayer(cfg, index)
