"""The architecture hyper-parameters the Llama-family forward needs, read from config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    """One code path serves llama, mistral and qwen2: the differences are all in these fields."""

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str) -> ModelConfig:
        """Read a Hugging Face config.json; raise ValueError naming what is unsupported."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        check_no_sliding_window(
            name,
            cfg.get("sliding_window") if model_type == "mistral" or cfg.get("use_sliding_window") else None,
            cfg.get("max_position_embeddings", 4096),
        )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope settings as one `rope_parameters` dict; older configs use two keys
        rope = dict(cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
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
            # qwen2 always carries q/k/v biases; llama/mistral only when config says so.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=name,
        )


def check_no_sliding_window(name: str, window: int | None, context: int) -> None:
    """Refuse a model whose attention is limited to a sliding window shorter than its context: the forward here
    attends over the whole context, so past `window` tokens its outputs would be silently wrong."""
    if window and window < context:
        raise ValueError(
            f"{name} declares sliding-window attention (each token sees the last {window} tokens, context "
            f"{context}); waferscale computes full attention only, which gives different (wrong) outputs past "
            f"{window} tokens, so it does not load this model"
        )
