"""Model configs: each family's config.json read into the fields its forward needs, sliding windows per layer."""

from __future__ import annotations

import pytest

from waferscale.models.config import FULL, SLIDING, ModelConfig

BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "max_position_embeddings": 32768,
}


def test_a_mistral_with_a_sliding_window_slides_every_layer():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096}, "m")
    assert [cfg.window(i) for i in range(2)] == [4096, 4096]


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 32768},  # as long as the context: the same as full attention
        {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},  # declared but unused
        {"model_type": "llama"},
    ],
)
def test_full_attention_models_have_no_window(extra):
    cfg = ModelConfig.from_hf({**BASE, **extra}, "m")
    assert cfg.num_layers == 2 and [cfg.window(i) for i in range(2)] == [None, None]


def test_a_qwen2_slides_from_max_window_layers_on():
    raw = {**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1}
    cfg = ModelConfig.from_hf(raw, "q")
    assert [cfg.window(i) for i in range(2)] == [None, 4096]


def test_qwen3_has_qk_norms_and_its_own_head_dim():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 128}, "q3")
    assert cfg.qk_norm and cfg.head_dim == 128 and cfg.family == "qwen3" and not cfg.attention_bias


def test_gemma3_interleaves_five_local_layers_with_one_global():
    raw = {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512, "head_dim": 256,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256}
    cfg = ModelConfig.from_hf(raw, "g")
    assert cfg.layer_types == ([SLIDING] * 5 + [FULL]) * 2
    assert cfg.window(0) == 512 and cfg.window(5) is None
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256


def test_gemma3_rope_parameters_per_layer_type_are_read():
    """transformers 5 writes rope settings per layer type."""
    params = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = ModelConfig.from_hf({**BASE, "model_type": "gemma3_text", "rope_parameters": params}, "g")
    assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_local_scaling is None


def test_a_multimodal_gemma3_config_serves_its_text_model():
    raw = {"model_type": "gemma3", "text_config": {**BASE, "model_type": "gemma3_text"}, "vision_config": {}}
    assert ModelConfig.from_hf(raw, "g").family == "gemma3"


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'.*qwen3.*gemma3_text"):
        ModelConfig.from_hf({**BASE, "model_type": "mamba"}, "m")
