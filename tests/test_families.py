"""Every family's forward against transformers at float32: tiny random Qwen3, Gemma 3, windowed Mistral and
windowed Qwen2 folders made by transformers here, each with a sliding window shorter than the longer prompts, give
the same greedy tokens and logprobs within 5e-3 on prompts of 6, 60 and 280 tokens; decoding, chunked prefill and batched
prompts that share a prefix included."""

from __future__ import annotations

import pytest
import torch
from test_kernels import whole_layer_against_modules

from waferscale import kernels
from waferscale.engine import LLMEngine, SamplingParams
from waferscale.models import load_model

WINDOW = 48
NEW_TOKENS = 8
COMMON = dict(
    vocab_size=49152,  # the built-in model's tokenizer, saved beside the weights
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _configs():
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config, Qwen3Config

    sliding, full = "sliding_attention", "full_attention"
    return {
        "qwen3": Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
        "qwen3-window": Qwen3Config(
            **COMMON, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "gemma3": Gemma3TextConfig(
            **COMMON,
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=[sliding, sliding, full, sliding],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            final_logit_softcapping=30.0,
        ),
        "mistral-window": MistralConfig(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False),
        "qwen2-window": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    }


@pytest.fixture(scope="module", params=["qwen3", "qwen3-window", "gemma3", "mistral-window", "qwen2-window"])
def family(request, tmp_path_factory, hf_tokenizer):
    """(transformers' model, ours at float32) of one tiny random family."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _configs()[request.param]
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from their init values, so that a misplaced 1 + w shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return ref, load_model(folder, dtype="float32", progress=False), folder


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _ours(loaded, prompts: list[list[int]], **engine_args) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20, **engine_args)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                                       temperature=0, logprobs=0))
    out = {str(i): ([], []) for i in range(len(prompts))}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id][0].extend(ev.token_ids)
            out[ev.request_id][1].extend(lp.logprob for lp in ev.logprobs)
    return [out[str(i)] for i in range(len(prompts))]


def _theirs(ref, ids: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        gen = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = gen.sequences[0, len(ids) :].tolist()
    return tokens, [float(s[0].log_softmax(-1)[t]) for s, t in zip(gen.scores, tokens)]


@pytest.mark.parametrize("length", [6, 60, 280])
def test_greedy_tokens_and_logprobs_match_transformers(family, length):
    ref, ours, _ = family
    ids = _prompt(length)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


def test_chunked_prefill_and_batching_give_the_same_tokens(family):
    """Prompts prefilled in chunks of 32 (each chunk's window reaching into earlier chunks), three at once, one of
    them sharing the first one's 70-token prefix."""
    _, ours, _ = family
    base = _prompt(280)
    prompts = [base, _prompt(60), base[:70] + _prompt(40)]
    alone = [_ours(ours, [p])[0] for p in prompts]
    together = _ours(ours, prompts, max_num_batched_tokens=32)
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(together, alone):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.mark.skipif(kernels.load() is None, reason="native kernels could not be built here (no C compiler)")
@pytest.mark.parametrize("quantization", ["none", "int4"])  # int8's layout: test_quant.py's Q5_0 model
def test_a_decode_step_runs_each_layer_as_one_native_call_bit_for_bit(family, quantization):
    """At bf16 (weights packed, or quantized in int4), a decode-only batch runs each layer (q/k norms, windows, Gemma's
    norms and GELU included) as one native call, and all layers in one: the same hidden states and stored keys and
    values, bit for bit, as the layer's modules; rows of 50 and 90 positions see only their windows."""
    _, _, folder = family
    loaded = load_model(folder, dtype="bfloat16", quantization=quantization, progress=False)
    whole_layer_against_modules(loaded.model, loaded.config, torch.tensor([1, 16, 50, 90]))


def test_a_multimodal_gemma3_folder_serves_its_text_model(tmp_path, hf_tokenizer):
    """A Gemma 3 checkpoint with a vision tower (config text_config, tensors under model.language_model.): the
    text model loads and gives transformers' text model's tokens; the vision weights are not loaded."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    cfg = _configs()["gemma3"]
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in ref.state_dict().items()
             if k != "lm_head.weight"}
    state["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    text = {**cfg.to_dict(), "model_type": "gemma3_text"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "vision_config": {"hidden_size": 8}}))
    hf_tokenizer.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="float32", progress=False)
    ids = _prompt(60)
    assert _ours(ours, [ids])[0][0] == _theirs(ref, ids)[0]
