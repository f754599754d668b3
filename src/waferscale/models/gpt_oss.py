"""gpt-oss: attention with q/k/v/o biases, a learned sink logit per head, sliding-window and full layers as
layer_types says, YaRN rope (its attention scaling applied to cos and sin, as transformers does); every
feed-forward a mixture of experts: a router with a bias, the top k logits then softmax over them, experts with
biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha gate), both clamped at swiglu_limit)."""

from __future__ import annotations

import torch
from torch import nn

from waferscale.kernels import DecodeLayerWeights
from waferscale.models.base import CausalLM, layer_decode_weights
from waferscale.models.config import ModelConfig
from waferscale.models.layers.attention import Attention, fused_decode_layer
from waferscale.models.layers.moe import TOPK_SOFTMAX, Routing, SparseMoE
from waferscale.models.layers.norm import RMSNorm
from waferscale.models.quant import QuantWeight

_STACKED_BIASES = (".mlp.experts.gate_proj.bias", ".mlp.experts.up_proj.bias", ".mlp.experts.down_proj.bias")
SWIGLU_ALPHA = 1.702  # fixed in the released model (config.json's swiglu_alpha where transformers writes one)


class GptOssDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + moe(norm(x)); the residual adds run inside the output projections."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            window=cfg.window(index),
            sinks=True,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        act = {"alpha": cfg.extra.get("swiglu_alpha", SWIGLU_ALPHA), "limit": cfg.extra.get("swiglu_limit", 7.0)}
        self.mlp = SparseMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.moe_intermediate_size,
            Routing(cfg.num_experts_per_tok, TOPK_SOFTMAX),
            act="swiglu_clamped",
            router_bias=True,
            expert_bias=True,
            act_params=act,
        )

    def forward(self, h: torch.Tensor, rope, kv, index: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(h), rope, kv, index, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def decode_weights(self) -> DecodeLayerWeights | None:
        """The layer's weights for the whole-layer decode call (sinks, output bias and experts included), or None
        where a part of it is not native."""
        return layer_decode_weights(self, (self.input_layernorm, self.post_attention_layernorm))

    def decode_native(self, kv, index: int, h: torch.Tensor, rope, weights: DecodeLayerWeights) -> None:
        """This layer for decode rows in one native call, in place on h."""
        fused_decode_layer(kv, index, h, rope, weights, self.self_attn)


class GptOssForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return GptOssDecoderLayer(cfg, index)

    def load_hf_state(self, tensors: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype) -> None:
        """gpt-oss's checkpoint names and expert layout turned into the per-expert ones the layers load."""
        split_gpt_oss_experts(tensors, self.cfg.num_experts, dtype)
        super().load_hf_state(tensors, dtype)


def split_gpt_oss_experts(tensors: dict, num_experts: int, dtype: torch.dtype) -> None:
    """Replace, in place, gpt-oss's router (`mlp.router`) and stacked experts by the names our layers load
    (`mlp.gate`, `mlp.experts.{j}.{gate,up,down}_proj.{weight,bias}`): float stacks as transformers saves them
    (`experts.gate_up_proj` [E, H, 2I], gate and up interleaved along the last dimension, `experts.down_proj`
    [E, I, H], and their biases [E, 2I], [E, H]), and the released MXFP4 blocks (`experts.gate_up_proj_blocks`
    [E, 2I, H / 32, 16] with `_scales` [E, 2I, H / 32], rows interleaved gate/up; `experts.down_proj_blocks`), kept
    in their blocks except at float32, which dequantizes them (the exact path)."""
    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    for name in [k for k in tensors if ".mlp.router." in k]:
        tensors[name.replace(".mlp.router.", ".mlp.gate.")] = tensors.pop(name)
    for name in [k for k in tensors if k.endswith(".self_attn.sinks.weight")]:  # as GGUF names them
        tensors[name.removesuffix(".weight")] = tensors.pop(name)
    for name in [k for k in tensors if k.endswith(_STACKED_BIASES)]:
        prefix, _, tail = name.partition(".mlp.experts.")
        for j, b in enumerate(tensors.pop(name).unbind(0)):  # GGUF's stacked expert biases [E, N]
            tensors[f"{prefix}.mlp.experts.{j}.{tail}"] = b
    for name in [k for k in tensors if k.endswith(".mlp.experts.down_proj_blocks")]:
        prefix = name.removesuffix("_blocks")
        for proj in ("gate_up_proj", "down_proj"):
            stem = prefix.replace("down_proj", proj)
            blocks, scales = tensors.pop(f"{stem}_blocks"), tensors.pop(f"{stem}_scales")
            if blocks.shape[0] != num_experts:
                raise ValueError(f"{stem}_blocks holds {blocks.shape[0]} experts, the config says {num_experts}")
            stack = Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)  # [E * N, K]
            del blocks, scales
            if dtype == torch.float32:  # the exact path: float [E, K, N], as transformers holds them
                stack = stack.dequantize().view(num_experts, stack.out_features // num_experts, -1).transpose(1, 2)
            tensors[stem] = stack
    for name in [k for k in tensors if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        prefix, _, proj = name.rpartition(".")
        stack, bias = tensors.pop(name), tensors.pop(f"{name}_bias")
        if proj == "gate_up_proj" and isinstance(stack, QuantWeight):
            _gate_rows_first(stack, num_experts)
        per = _per_expert(stack, num_experts)
        for j in range(num_experts):
            w = per[j]
            if proj == "gate_up_proj":  # gate is every even output, up every odd one
                if isinstance(w, QuantWeight):  # reordered above (_gate_rows_first): consecutive rows, views
                    half = w.out_features // 2
                    gate, up = w.take_rows(slice(0, half)), w.take_rows(slice(half, None))
                else:
                    gate, up = w[:, 0::2].T, w[:, 1::2].T
                tensors[f"{prefix}.{j}.gate_proj.weight"], tensors[f"{prefix}.{j}.up_proj.weight"] = gate, up
                tensors[f"{prefix}.{j}.gate_proj.bias"] = bias[j, 0::2]
                tensors[f"{prefix}.{j}.up_proj.bias"] = bias[j, 1::2]
            else:
                tensors[f"{prefix}.{j}.down_proj.weight"] = w if isinstance(w, QuantWeight) else w.T
                tensors[f"{prefix}.{j}.down_proj.bias"] = bias[j]


def _gate_rows_first(stack: QuantWeight, num_experts: int) -> None:
    """Reorder, in place and an expert at a time, each expert's interleaved gate/up rows (gate every even row) to
    its gate rows then its up rows: each expert's gate and up are then consecutive rows of the stack, which the
    projections take as views (layouts.adjacent_rows) rather than a copy of every expert's rows."""
    for t in (stack.qweight, stack.scales):
        per = t.view(num_experts, -1, *t.shape[1:])
        for j in range(num_experts):
            rows = per[j]
            rows.copy_(rows.view(rows.shape[0] // 2, 2, *rows.shape[1:]).transpose(0, 1).contiguous().view(rows.shape))


def _per_expert(stack, num_experts: int) -> list:
    """Each expert's part of a stack: a float [E, K, N] stack's [K, N] views, or a QuantWeight of E * N rows'
    [N, K] rows."""
    if isinstance(stack, QuantWeight):
        n = stack.out_features // num_experts
        return [stack.take_rows(slice(j * n, (j + 1) * n)) for j in range(num_experts)]
    if stack.dim() != 3 or stack.shape[0] != num_experts:
        raise ValueError(f"stacked experts have shape {tuple(stack.shape)}, expected [{num_experts}, K, N]")
    return list(stack.unbind(0))
