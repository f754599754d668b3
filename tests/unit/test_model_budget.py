"""What a configured model counts against --memory-budget before its first load: weights on disk (dequantized
where it will be), KV cache, and its draft model's weights and KV cache."""

from __future__ import annotations

from waferscale.api.model_loading import estimate_bytes
from waferscale.engine.settings import EngineSettings
from waferscale.models.source import builtin_model_path

MIB = 1 << 20


def test_a_gguf_counts_its_blocks_and_its_kv_cache():
    size = builtin_model_path().stat().st_size
    assert estimate_bytes(EngineSettings(kv_cache_memory=64 * MIB)) == size + 64 * MIB


def test_a_gguf_dequantized_to_float32_counts_four_times_its_blocks():
    size = builtin_model_path().stat().st_size
    settings = EngineSettings(dtype="float32", kv_cache_memory=64 * MIB)
    assert estimate_bytes(settings) == 4 * size + 64 * MIB


def test_a_self_draft_counts_the_blocks_again_and_a_quarter_of_the_kv_cache():
    size = builtin_model_path().stat().st_size
    settings = EngineSettings(kv_cache_memory=64 * MIB, speculative="draft", draft_model="self:int4")
    assert estimate_bytes(settings) == 2 * size + 64 * MIB + 16 * MIB


def test_a_draft_model_counts_its_own_weights_and_its_kv_pool():
    size, gemma = builtin_model_path().stat().st_size, builtin_model_path("gemma-3-270m")
    settings = EngineSettings(
        model=str(gemma), kv_cache_memory=64 * MIB, speculative="draft", draft_model="smollm2-135m-instruct",
        draft_kv_cache_memory=8 * MIB,
    )  # fmt: skip
    assert estimate_bytes(settings) == gemma.stat().st_size + 64 * MIB + size + 8 * MIB


def test_a_model_that_is_not_there_counts_nothing():
    assert estimate_bytes(EngineSettings(model="no-such-model.gguf")) == 0
