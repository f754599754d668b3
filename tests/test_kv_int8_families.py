"""Every family serves with an int8 KV cache: tiny random folders made by transformers (Qwen3, Gemma 3 and windowed
Mistral and Qwen2 as test_families makes them, Qwen3-MoE as test_moe, gpt-oss with its sinks and window as
test_gpt_oss), prompts longer than their windows prefilled in chunks of 32, then decoded. Greedy tokens may differ
from float32 KV's, so the check is on log-probabilities: the int8 engine's logprobs of its prompt and of its own
tokens stay within a few thousandths of a nat of a float32-KV engine scoring the same tokens, and within a few
times what bfloat16 KV moves them (scales off by a tenth move them 40-60 times as much)."""

from __future__ import annotations

import pytest
import torch
from test_families import _configs
from test_gpt_oss import _gpt_oss_config
from test_gpt_oss import _randomize as _randomize_gpt_oss
from test_moe import _qwen3_moe_config
from test_moe import _randomize as _randomize_moe

from waferscale import kernels
from waferscale.engine import LLMEngine, SamplingParams
from waferscale.engine.speculation import SpeculativeConfig
from waferscale.models import load_model

PROMPT, NEW_TOKENS = 90, 6


def _norms_away_from_init(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)


FAMILIES = {  # name: (transformers config, how test_* randomizes it)
    "qwen3": (lambda: _configs()["qwen3"], _norms_away_from_init),
    "gemma3": (lambda: _configs()["gemma3"], _norms_away_from_init),
    "mistral-window": (lambda: _configs()["mistral-window"], _norms_away_from_init),
    "qwen2-window": (lambda: _configs()["qwen2-window"], _norms_away_from_init),
    "qwen3-moe": (_qwen3_moe_config, _randomize_moe),
    "gpt-oss": (_gpt_oss_config, _randomize_gpt_oss),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, hf_tokenizer):
    """Ours, loaded at float32, of one tiny random family."""
    from transformers import AutoModelForCausalLM

    config, randomize = FAMILIES[request.param]
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()
    randomize(ref)
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return request.param, load_model(folder, dtype="float32", progress=False)


def _generate(loaded, kv_cache_dtype: str, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens, and the logprobs of prompt tokens 1.. followed by those of the tokens generated."""
    engine = LLMEngine(loaded, kv_cache_bytes=8 << 20, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(
        max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, logprobs=0, prompt_logprobs=True
    )
    engine.add_request("r", ids, params)
    tokens, prompt_lps, lps = [], [], []
    while engine.has_work():
        for ev in engine.step():
            tokens.extend(ev.token_ids)
            lps.extend(lp.logprob for lp in ev.logprobs)
            prompt_lps.extend(lp.logprob for lp in (ev.prompt_logprobs or [])[1:])
    assert engine.blocks.num_used == 0
    return tokens, prompt_lps + lps


def _deviations(loaded) -> tuple[list[float], list[float]]:
    """|logprob - float32 KV's logprob| of every scored token with int8 KV, and with bfloat16 KV: the prompt's
    (chunked prefill), then those of the int8 engine's own greedy tokens (decode steps)."""
    g = torch.Generator().manual_seed(PROMPT)
    ids = torch.randint(100, 40000, (PROMPT,), generator=g).tolist()
    tokens, int8_lps = _generate(loaded, "int8", ids, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS
    n = len(int8_lps)
    assert n == PROMPT - 1 + NEW_TOKENS
    # the same tokens scored with float32 and bfloat16 KV
    float_lps, bf16_lps = (_generate(loaded, dtype, ids + tokens, 1)[1][:n] for dtype in ("float32", "bfloat16"))
    return [abs(a - b) for a, b in zip(int8_lps, float_lps)], [abs(a - b) for a, b in zip(bf16_lps, float_lps)]


def _close(deviations: tuple[list[float], list[float]]) -> bool:
    """int8 KV within a few thousandths of a nat of float32 KV, and within a few times what bf16 KV's rounding
    moves (the tiny models' flat distributions move little: scales off by a tenth move them 40-60 times bf16's)."""
    int8, bf16 = deviations
    mean, mean_bf16 = sum(int8) / len(int8), sum(bf16) / len(bf16)
    return mean < 5e-3 and max(int8) < 0.03 and mean < 8 * mean_bf16


@pytest.mark.skipif(kernels.load() is None, reason="native kernels unavailable")
def test_int8_kv_serves_and_scores_as_float32_kv_does(family):
    _, loaded = family
    assert _close(_deviations(loaded))


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"], indirect=True)
def test_without_native_kernels_int8_kv_scores_as_float32_kv_does(family, monkeypatch):
    """The PyTorch fallback (pages dequantized as they are read), on the families with windows and sinks."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    _, loaded = family
    assert _close(_deviations(loaded))


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_speculative_drafts_verified_over_int8_kv_change_nothing(family):
    """Each token's keys and values are rounded on their own scale, so n-gram drafts verified as decode rows in one
    forward store and read what decoding one token a step does: the same greedy tokens, past the window."""
    _, loaded = family
    ids = (torch.randint(100, 40000, (20,), generator=torch.Generator().manual_seed(3)).tolist() * 5)[:90]
    outputs = []
    for method in ("none", "ngram"):
        engine = LLMEngine(loaded, kv_cache_bytes=8 << 20, max_num_batched_tokens=32, kv_cache_dtype="int8",
                           speculative=SpeculativeConfig(method))  # fmt: skip
        engine.add_request("r", ids, SamplingParams(max_tokens=24, min_tokens=24, temperature=0))
        tokens = []
        while engine.has_work():
            for ev in engine.step():
                tokens.extend(ev.token_ids)
        outputs.append((tokens, engine.stats().speculative_draft_tokens))
    (plain, _), (speculated, drafts) = outputs
    assert drafts > 0 and speculated == plain

