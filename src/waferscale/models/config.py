"""The architecture hyper-parameters a family's forward needs, read from config.json or GGUF metadata (torch-free:
`waferscale serve` checks a model's family before PyTorch loads)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from waferscale.models.registry import FAMILIES, family_for_hf

SUPPORTED_ARCHITECTURES = tuple(t for f in FAMILIES for t in f.hf_types)
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class ModelConfig:
    """Every family's forward reads its differences from these fields; `architecture` names the family's
    Hugging Face model_type (or, for a converted GGUF, the GGUF architecture it came from)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)
    # attention layout: "full_attention" or "sliding_attention" per layer (None: all full) and the window
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # the rope base of sliding layers (None: rope_theta)
    rope_local_scaling: dict[str, Any] | None = None
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3, Gemma 3)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None
    # mixture of experts (0 experts: every layer dense): experts a layer, experts a token, whether the k weights are
    # renormalised to sum to 1, each expert's width, and which layers are sparse (every decoder_sparse_step-th one,
    # except mlp_only_layers, which keep a dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def family(self) -> str:
        """The registry's family name for this architecture."""
        return family_for_hf(self.architecture).name

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it sees the whole context."""
        if self.sliding_window is None or not self.layer_types or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts (as transformers' Qwen3-MoE decides)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """Read a Hugging Face config.json (a multimodal Gemma 3's text_config too); raise ValueError naming what
        is unsupported."""
        if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
        model_type = cfg.get("model_type", "")
        family = family_for_hf(model_type)
        if family is None:
            raise ValueError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        theta, scaling, local_theta, local_scaling = _rope(cfg)
        out = cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            rope_local_scaling=local_scaling,
            # qwen2 always carries q/k/v biases; llama/mistral only when config says so.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.name == "gemma3")),
            name=name,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        )
        family.read_hf(out, cfg)
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
        return out


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float | None, dict | None]:
    """(theta, scaling) of full-attention layers and of sliding ones (None: the same), from the two layouts
    transformers writes: rope_theta/rope_scaling keys (< 5), or `rope_parameters` (>= 5; per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta = full.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0
        local_theta = local.pop("rope_theta", None) or cfg.get("rope_local_base_freq") or 10_000.0
        scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
        local_scaling = local if local.get("rope_type", "default") != "default" else None
        return theta, scaling, local_theta, local_scaling
    rope = dict(params)
    theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    local_theta = cfg.get("rope_local_base_freq")
    return theta, scaling, local_theta, None


def layer_types_from(cfg: dict[str, Any], num_layers: int, window: int | None, first_sliding: int = 0) -> list[str]:
    """config.json's layer_types, or sliding layers from `first_sliding` on where a window is set."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        return list(types)
    return [SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)]


def gemma_pattern(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3's interleaving: every `pattern`-th layer global, the rest sliding."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def embed_scale(cfg: ModelConfig) -> float | None:
    """Gemma multiplies embeddings by sqrt(hidden_size); other families by nothing."""
    return math.sqrt(cfg.hidden_size) if cfg.family == "gemma3" else None
