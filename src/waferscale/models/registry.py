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
