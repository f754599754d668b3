"""Model configs: a sliding-window model is refused with the reason, not served with full attention."""

from __future__ import annotations

import pytest

from waferscale.models.config import ModelConfig

BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "max_position_embeddings": 32768,
}


def test_a_mistral_with_a_sliding_window_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="sliding-window attention.*4096.*full attention"):
        ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096}, "m")


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "mistral", "sliding_window": 32768},  # as long as the context: the same as full attention
        {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},  # declared but unused
        {"model_type": "llama"},
    ],
)
def test_full_attention_models_load(extra):
    assert ModelConfig.from_hf({**BASE, **extra}, "m").num_layers == 2


def test_a_qwen2_that_uses_its_window_is_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "q")
