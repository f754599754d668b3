"""Which family serves a model: a Hugging Face `model_type` or GGUF `general.architecture` maps to the family's
model class, its config reading and its GGUF tensor names. Adding a family is one model file plus one entry here.
Torch-free: the model class is named, and imported only when a model is built."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _llama_hf(cfg, raw: dict[str, Any]) -> None:
    from waferscale.models.config import layer_types_from

    model_type = raw.get("model_type")
    if model_type == "mistral":
        window = raw.get("sliding_window")
    else:
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = raw.get("max_window_layers", 0) if model_type == "qwen2" else 0
    if window is not None and window < cfg.max_position_embeddings:
        cfg.sliding_window = window
        cfg.layer_types = layer_types_from(raw, cfg.num_layers, window, first)


def _qwen3_hf(cfg, raw: dict[str, Any]) -> None:
    from waferscale.models.config import layer_types_from

    cfg.qk_norm = True
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is not None and window < cfg.max_position_embeddings:
        cfg.sliding_window = window
        cfg.layer_types = layer_types_from(raw, cfg.num_layers, window, raw.get("max_window_layers", 0))


def _qwen3_moe_hf(cfg, raw: dict[str, Any]) -> None:
    """Qwen3 attention; experts as config.json says (transformers 5 writes num_local_experts for num_experts)."""
    _qwen3_hf(cfg, raw)
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not experts or not raw.get("num_experts_per_tok") or not raw.get("moe_intermediate_size"):
        raise ValueError("a qwen3_moe config.json needs num_experts, num_experts_per_tok and moe_intermediate_size")
    cfg.num_experts = experts
    cfg.num_experts_per_tok = raw["num_experts_per_tok"]
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    cfg.moe_intermediate_size = raw["moe_intermediate_size"]
    cfg.decoder_sparse_step = raw.get("decoder_sparse_step") or 1
    cfg.mlp_only_layers = list(raw.get("mlp_only_layers") or [])


def _qwen3_moe_gguf(cfg, meta) -> None:
    """llama.cpp's qwen3moe: every layer sparse, the k weights always renormalised."""
    cfg.qk_norm = True
    cfg.num_experts = meta("expert_count", 0)
    cfg.num_experts_per_tok = meta("expert_used_count", 0)
    cfg.moe_intermediate_size = meta("expert_feed_forward_length", None)
    if not cfg.num_experts or not cfg.num_experts_per_tok or not cfg.moe_intermediate_size:
        raise ValueError("a qwen3moe GGUF needs expert_count, expert_used_count and expert_feed_forward_length")
    cfg.norm_topk_prob = True


def _gpt_oss_hf(cfg, raw: dict[str, Any]) -> None:
    """Every layer sparse (experts as wide as intermediate_size), sliding and full layers alternating unless
    layer_types says otherwise, biases on q/k/v/o; the clamped SwiGLU's limit (and alpha) kept in extra."""
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    per_token = raw.get("num_experts_per_tok", raw.get("experts_per_token"))
    if not experts or not per_token:
        raise ValueError("a gpt_oss config.json needs num_local_experts and num_experts_per_tok")
    cfg.num_experts, cfg.num_experts_per_tok = experts, per_token
    cfg.moe_intermediate_size = raw["intermediate_size"]
    cfg.hidden_act = "swiglu_clamped"
    cfg.attention_bias = bool(raw.get("attention_bias", True))
    cfg.extra["swiglu_limit"] = float(raw.get("swiglu_limit", 7.0))
    cfg.extra["swiglu_alpha"] = float(raw.get("swiglu_alpha", 1.702))
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        cfg.rope_theta = 150_000.0  # transformers' default for gpt-oss
    window = raw.get("sliding_window")
    if window:
        cfg.sliding_window = window
        cfg.layer_types = raw.get("layer_types") or gpt_oss_pattern(cfg.num_layers)


def _gpt_oss_gguf(cfg, meta) -> None:
    """llama.cpp's gpt-oss: every layer sparse, even layers sliding (its swa pattern 2), the clamped SwiGLU at
    llama.cpp's fixed limit 7 and alpha 1.702, and YaRN without truncated correction dims (as the model and
    transformers compute it)."""
    cfg.num_experts = meta("expert_count", 0)
    cfg.num_experts_per_tok = meta("expert_used_count", 0)
    cfg.moe_intermediate_size = meta("expert_feed_forward_length", None) or cfg.intermediate_size
    if not cfg.num_experts or not cfg.num_experts_per_tok:
        raise ValueError("a gpt-oss GGUF needs expert_count and expert_used_count")
    cfg.hidden_act = "swiglu_clamped"
    cfg.attention_bias = True
    cfg.extra.update(swiglu_limit=7.0, swiglu_alpha=1.702)
    window = meta("attention.sliding_window", None)
    if window:
        cfg.sliding_window = window
        cfg.layer_types = gpt_oss_pattern(cfg.num_layers)
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "yarn":
        cfg.rope_scaling["truncate"] = False


def gpt_oss_pattern(num_layers: int) -> list[str]:
    """gpt-oss's interleaving: sliding, full, sliding, full, ..."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _gemma3_hf(cfg, raw: dict[str, Any]) -> None:
    from waferscale.models.config import gemma_pattern

    cfg.qk_norm = True
    cfg.hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    cfg.query_pre_attn_scalar = raw.get("query_pre_attn_scalar", 256)
    cfg.final_logit_softcapping = raw.get("final_logit_softcapping")
    cfg.sliding_window = raw.get("sliding_window", 4096)
    cfg.layer_types = raw.get("layer_types") or gemma_pattern(cfg.num_layers, raw.get("sliding_window_pattern", 6))
    if cfg.rope_local_theta is None:
        cfg.rope_local_theta = raw.get("rope_local_base_freq", 10_000.0)


def _gemma3_gguf(cfg, meta: Callable[[str, Any], Any]) -> None:
    """llama.cpp's Gemma 3: local rope base 10000, every 6th layer global, attention scaled by head_dim^-1/2."""
    from waferscale.models.config import gemma_pattern

    cfg.qk_norm = True
    cfg.hidden_act = "gelu_pytorch_tanh"
    cfg.query_pre_attn_scalar = cfg.head_dim
    cfg.sliding_window = meta("attention.sliding_window", 4096)
    cfg.layer_types = gemma_pattern(cfg.num_layers)
    cfg.rope_local_theta = 10_000.0
    cfg.final_logit_softcapping = meta("final_logit_softcapping", None)


def _qwen3_gguf(cfg, meta) -> None:
    cfg.qk_norm = True


def _llama_gguf(cfg, meta) -> None:
    from waferscale.models.config import layer_types_from

    window = meta("attention.sliding_window", None)
    if window and window < cfg.max_position_embeddings:
        cfg.sliding_window = window
        cfg.layer_types = layer_types_from({}, cfg.num_layers, window)


@dataclass(frozen=True)
class Family:
    """One model family: its model class ('module:Class'), the names it answers to, and how it reads configs."""

    name: str
    model: str
    hf_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    read_hf: Callable[[Any, dict[str, Any]], None]
    read_gguf: Callable[[Any, Callable[[str, Any], Any]], None]
    gguf_tensors: dict[str, str] = field(default_factory=dict)  # per-layer names beyond the Llama ones
    gguf_permuted_qk: bool = False  # llama.cpp permutes q/k rows for interleaved rope (its llama arch only)
    gguf_norm_offset: float = 0.0  # added to every norm weight read from GGUF (llama.cpp stores Gemma's 1 + w)

    def model_class(self) -> type:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# the router, and each projection of all experts stacked in one tensor (split per expert at load, see layers/moe.py)
_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
FAMILIES: tuple[Family, ...] = (
    Family("llama", "waferscale.models.llama:LlamaForCausalLM", ("llama", "mistral", "qwen2"),
           ("llama", "mistral", "qwen2"), _llama_hf, _llama_gguf, gguf_permuted_qk=True),
    Family("qwen3", "waferscale.models.qwen3:Qwen3ForCausalLM", ("qwen3",), ("qwen3",), _qwen3_hf, _qwen3_gguf,
           gguf_tensors=_QK_NORMS),
    Family("gemma3", "waferscale.models.gemma3:Gemma3ForCausalLM", ("gemma3_text", "gemma3"), ("gemma3",),
           _gemma3_hf, _gemma3_gguf,
           gguf_tensors={**_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
                         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
           gguf_norm_offset=-1.0),
    Family("qwen3_moe", "waferscale.models.qwen3_moe:Qwen3MoeForCausalLM", ("qwen3_moe",), ("qwen3moe",),
           _qwen3_moe_hf, _qwen3_moe_gguf, gguf_tensors={**_QK_NORMS, **_EXPERTS}),
    Family("gpt_oss", "waferscale.models.gpt_oss:GptOssForCausalLM", ("gpt_oss",), ("gpt-oss",), _gpt_oss_hf,
           _gpt_oss_gguf,
           gguf_tensors={**_EXPERTS, "attn_sinks": "self_attn.sinks",
                         "post_attention_norm": "post_attention_layernorm"}),
)


def family_for_hf(model_type: str) -> Family | None:
    """The family serving a Hugging Face model_type (or a GGUF architecture), or None."""
    for f in FAMILIES:
        if model_type in f.hf_types or model_type in f.gguf_archs:
            return f
    return None


def family_for_gguf(arch: str) -> Family | None:
    """The family serving a GGUF general.architecture, or None."""
    for f in FAMILIES:
        if arch in f.gguf_archs:
            return f
    return None


GGUF_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.gguf_archs)
