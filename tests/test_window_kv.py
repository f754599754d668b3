"""Sliding-window layers keep KV for their window only, and stay exact: tiny random Gemma 3 (windowed and global
layers interleaved) and Mistral (every layer windowed) folders with a window of 16, generating 40 tokens after 300
of context in chunks of 32, give transformers' greedy tokens at float32, while the window layers hold a few blocks;
prefix-cache hits and n-gram speculation beyond the window give the same tokens."""

from __future__ import annotations

import pytest
import torch

from waferscale.engine import LLMEngine, SamplingParams
from waferscale.engine.speculation import SpeculativeConfig
from waferscale.models import load_model

WINDOW = 16
NEW_TOKENS = 40
COMMON = dict(
    vocab_size=49152,  # the built-in model's tokenizer, saved beside the weights
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    sliding_window=WINDOW,
)


def _config(name: str):
    from transformers import Gemma3TextConfig, MistralConfig

    if name == "gemma3":
        sliding, full = "sliding_attention", "full_attention"
        return Gemma3TextConfig(**COMMON, head_dim=32, layer_types=[sliding, sliding, full, sliding])
    return MistralConfig(**COMMON, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def family(request, tmp_path_factory, hf_tokenizer):
    """(transformers' model, ours at float32) of one tiny random windowed family."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_config(request.param), dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return ref, load_model(folder, dtype="float32", progress=False)


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(n + seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _theirs(ref, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens, and the most KV pages held at once."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most = 0
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].extend(ev.token_ids)
        most = max(most, engine.blocks.num_used)
    return [out[str(i)] for i in range(len(prompts))], most


def _engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(loaded, kv_cache_bytes=8 << 20, max_num_batched_tokens=32, **kw)


def test_generation_far_beyond_the_window_matches_transformers_in_a_few_window_blocks(family):
    ref, ours = family
    ids = _prompt(300)
    engine = _engine(ours)
    (tokens,), most = _run(engine, [ids])
    assert tokens == _theirs(ref, ids)
    # pages a block of each kind takes: the whole-context layers hold every block of the 340 positions, the window
    # layers what a chunk of 32 and the 15 positions before it span (4 blocks of 16), not 22
    kinds = engine.blocks.kinds
    full = sum(k.pages for k in kinds if k.window is None)
    window = sum(k.pages for k in kinds if k.window is not None)
    assert window and most <= full * -(-(300 + NEW_TOKENS) // 16) + window * 4
    assert engine.blocks.num_used == 0


def test_prefix_hits_resume_mid_context_with_the_window_blocks_they_need(family):
    """A finished prompt's blocks stay cached: the same prompt, and one sharing its first 250 tokens, resume from
    the cache (the window layers' blocks behind the resumption point included) and still give transformers' tokens."""
    ref, ours = family
    first = _prompt(300)
    engine = _engine(ours)
    _run(engine, [first])
    branch = first[:250] + _prompt(50, seed=1)
    (again, other), _ = _run(engine, [first, branch])
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 2 * 15  # 18 and 15 blocks of 16 found
    # /metrics' gauges count pages: all idle now, the cached ones among the free
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == engine.blocks.num_blocks - 1
    assert 0 < stats.kv_blocks_cached <= stats.kv_blocks_free
    assert again == _theirs(ref, first) and other == _theirs(ref, branch)


def test_speculative_drafts_verified_beyond_the_window_change_nothing(family):
    """n-gram drafts over a repetitive prompt, verified as decode rows, give the tokens decoding one at a time does."""
    ref, ours = family
    ids = (_prompt(20) * 15)[:300]
    (tokens,), _ = _run(_engine(ours, speculative=SpeculativeConfig("ngram")), [ids])
    engine = _engine(ours, speculative=SpeculativeConfig("ngram"))
    assert tokens == _theirs(ref, ids)
    (again,), _ = _run(engine, [ids])
    assert again == tokens and engine.stats().speculative_draft_tokens > 0
