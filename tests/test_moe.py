"""Mixture of experts: routing as transformers routes (Qwen3-MoE's softmax-then-top-k, gpt-oss's top-k-then-softmax,
ties included); the layer against transformers' Qwen3-MoE and Qwen2-MoE (shared expert) blocks; quantized experts
against a float reference with rows routed unevenly; a tiny random Qwen3-MoE folder made by transformers here, at
float32: greedy tokens identical and logprobs within 5e-3 on prompts of 6, 60 and 280 tokens, the same tokens alone
and among 15 others; and qwen3moe GGUFs (stacked expert tensors) that load, from transformers' weights and from
quantized blocks split per expert without a copy."""

from __future__ import annotations

import gguf
import httpx
import numpy as np
import pytest
import torch
from gguf_writing import f32, finish, moe_writer
from test_families import NEW_TOKENS, _ours, _prompt, _theirs
from test_quant import random_blocks

from waferscale import kernels
from waferscale.models import load_model, quant
from waferscale.models.layers.linear import LoadContext
from waferscale.models.layers.moe import SOFTMAX_TOPK, TOPK_SOFTMAX, NativeExperts, Routing, SparseMoE
from waferscale.models.quant import QuantLinear, from_gguf

native = kernels.load()
EXPERTS, ACTIVE = 8, 2


def _qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    args = dict(
        vocab_size=49152,  # the built-in model's tokenizer, saved beside the weights
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=ACTIVE,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # a dense layer between two sparse ones
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return Qwen3MoeConfig(**{**args, **overrides})


def _randomize(model) -> None:
    """Norms away from 1 and routers sharp enough that tokens choose different experts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, hf_tokenizer):
    """(transformers' tiny random Qwen3-MoE, its folder, ours loaded at float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(_qwen3_moe_config(), dtype=torch.float32).eval()
    _randomize(ref)
    folder = tmp_path_factory.mktemp("qwen3-moe")
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return ref, folder, load_model(folder, dtype="float32", progress=False)


# ---------------------------------------------------------------- routing and the layer


def test_softmax_topk_routing_matches_transformers_with_ties():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = _qwen3_moe_config(hidden_size=16)
    for norm in (True, False):
        cfg.norm_topk_prob = norm
        router = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(router.weight)
        router.weight.data[5] = router.weight.data[2]  # experts 2 and 5 tie for every token
        x = torch.randn(40, 16)
        x[:4] = 0  # and every expert ties for these
        logits, want_w, want_ids = router(x)
        got_w, got_ids = Routing(ACTIVE, SOFTMAX_TOPK, norm).route(logits)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_w, want_w)


def test_topk_softmax_routing_matches_gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=4))
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(40, 16)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = Routing(4, TOPK_SOFTMAX).route(logits)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-7)


def _load_block(ours: SparseMoE, theirs_state: dict[str, torch.Tensor], ctx: LoadContext) -> None:
    """Our layer from a transformers block's state dict (fused experts as transformers holds them in memory)."""
    from waferscale.models.layers.moe import split_stacked_experts

    state = {f"model.mlp.{k}": v for k, v in theirs_state.items()}
    split_stacked_experts(state, len(ours.experts))
    for path, module in ours.named_modules():
        name = f"model.mlp.{path}" if path else "model.mlp"
        if hasattr(module, "load"):
            if path.endswith("gate_up_proj"):
                owner = name.rsplit(".", 1)[0]
                module.load([state.pop(f"{owner}.gate_proj.weight"), state.pop(f"{owner}.up_proj.weight")], None, name)
            else:
                module.load([state.pop(f"{name}.weight")], None, name)
    assert not state
    for m in ours.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading(ctx)


def test_layer_matches_transformers_blocks():
    """Qwen3-MoE's sparse block, and Qwen2-MoE's with its sigmoid-gated shared expert, at float32."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(1)
    ctx = LoadContext(torch.float32, native, kernels.cpu_has_native_bf16())
    qwen3 = Qwen3MoeSparseMoeBlock(_qwen3_moe_config())
    qwen2 = Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=False)
    )
    cases = [
        (qwen3, SparseMoE(64, 8, 32, Routing(ACTIVE, SOFTMAX_TOPK, True))),
        (qwen2, SparseMoE(64, 8, 32, Routing(ACTIVE, SOFTMAX_TOPK, False), shared_intermediate_size=48,
                          shared_gate=True)),
    ]
    for theirs, ours in cases:
        for p in theirs.parameters():
            torch.nn.init.normal_(p, std=0.3)
        _load_block(ours, theirs.state_dict(), ctx)
        x = torch.randn(1, 37, 64)
        with torch.no_grad():
            want = theirs(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x[0], residual=torch.ones(37, 64))
        torch.testing.assert_close(got - 1, want[0], rtol=1e-5, atol=1e-5)


def test_layer_with_gpt_oss_parameters_matches_transformers():
    """The same layer with gpt-oss's parameters (router bias, top-k then softmax, expert biases, clamped SwiGLU)
    against transformers' GptOssMLP at float32; its fused, transposed, interleaved gate/up converted here."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(6)
    hidden, inter, experts, k = 64, 32, 8, 4
    theirs = GptOssMLP(GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                    num_experts_per_tok=k))
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = SparseMoE(hidden, experts, inter, Routing(k, TOPK_SOFTMAX), act="swiglu_clamped", router_bias=True,
                     expert_bias=True)
    ours.gate.load([theirs.router.weight.detach()], theirs.router.bias.detach(), "router")
    ex = theirs.experts
    for e, expert in enumerate(ours.experts):
        w, b = ex.gate_up_proj[e].detach().T, ex.gate_up_proj_bias[e].detach()  # [2I, H], gate and up interleaved
        expert.gate_up_proj.load([w[0::2], w[1::2]], torch.cat([b[0::2], b[1::2]]), f"experts.{e}.gate_up_proj")
        expert.down_proj.load([ex.down_proj[e].detach().T.contiguous()], ex.down_proj_bias[e].detach(), "down")
    ctx = LoadContext(torch.float32, native, kernels.cpu_has_native_bf16())
    for m in ours.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading(ctx)
    x = torch.randn(1, 29, hidden)
    with torch.no_grad():
        want = theirs(x)[0][0]
    gate_up = ours.experts[0].gate_up_proj(x[0]).split(inter, dim=-1)
    assert (gate_up[0] > 7).any() and (gate_up[1].abs() > 7).any()  # the clamps matter
    torch.testing.assert_close(ours(x[0]), want, rtol=1e-4, atol=1e-4)  # float32 sums in another order


@pytest.mark.skipif(native is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_experts_match_a_float_reference_with_uneven_routing(kind, monkeypatch):
    """Experts from GGUF blocks against the same weights dequantized, tokens routed so that expert 0 takes every
    row and expert 3 none; bf16 and float32 activations (kept float32 in the kernel: rounding them to int8 for
    small batches is the kernels' accuracy policy, tested in test_quant.py)."""
    monkeypatch.setattr(quant.modules, "ACT_MODE", quant.ACTIVATION_MODES["float32"])
    torch.manual_seed(4)
    hidden, inter, experts, k = 256, 256, 4, 2
    router = torch.randn(experts, hidden) * 0.01
    router[:, 0] = torch.tensor([10.0, 0.0, 0.5, -10.0])  # x[:, 0] is large: 0 always first, 3 never chosen
    blocks = {}
    for e in range(experts):
        for proj, shape in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            blocks[e, proj] = from_gguf(random_blocks(kind, *shape, seed=len(blocks)), kind, *shape)
    for dtype in (torch.float32, torch.bfloat16):
        layer = SparseMoE(hidden, experts, inter, Routing(k, SOFTMAX_TOPK, True))
        layer.gate.load([router.to(dtype)], None, "gate")
        for e, expert in enumerate(layer.experts):
            for proj in ("gate_up_proj", "down_proj"):
                getattr(expert, proj).load([blocks[e, proj]], None, f"experts.{e}.{proj}")
        ctx = LoadContext(dtype, native, kernels.cpu_has_native_bf16())
        for m in layer.modules():
            if hasattr(m, "process_weights_after_loading"):
                m.process_weights_after_loading(ctx)
        assert all(isinstance(p.quant, QuantLinear) for e in layer.experts for p in (e.gate_up_proj, e.down_proj))
        for rows in (1, 5, 40):
            x = torch.randn(rows, hidden)
            x[:, 0] = 4.0
            x = x.to(dtype)
            w, ids = layer.routing.route(layer.gate(x))
            assert (ids == 0).any(-1).all() and not (ids == 3).any()
            want = torch.zeros(rows, hidden)
            for t in range(rows):
                for slot in range(k):
                    gate_up, down = (blocks[int(ids[t, slot]), p].dequantize() for p in ("gate_up_proj", "down_proj"))
                    g, u = (x[t].float() @ gate_up.T).split(inter)
                    want[t] += w[t, slot] * ((torch.nn.functional.silu(g) * u) @ down.T)
            got = layer(x).float()
            assert ((got - want).norm() / want.norm()) < (1e-5 if dtype == torch.float32 else 0.01), (rows, dtype)


GPT_OSS = "gpt-oss"  # router and expert biases, top k then softmax, the clamped SwiGLU


def _expert_weight(kind: str, shape: tuple[int, int], seed: int):
    """One expert projection's weight in `kind`: bf16, a GGUF block type, or MXFP4 in either nibble order."""
    from waferscale.models.quant.mxfp4 import quantize_mxfp4

    if kind == "bf16":
        return (torch.randn(*shape) * 0.05).bfloat16()
    if kind.startswith("MXFP4"):
        return quantize_mxfp4(torch.randn(*shape) * 0.1, interleaved=kind.endswith("interleaved"))
    return from_gguf(random_blocks(kind, *shape, seed=seed), kind, *shape)


def _native_layer(kind: str, routing, hidden: int = 256, inter: int = 256, experts: int = 8) -> SparseMoE:
    """A bf16 layer of `kind` experts (seeded), routed by `routing` (gpt-oss: biases and the clamped SwiGLU), its
    weights processed for the native calls; expert 0 is in every row's top 2 where x[:, 0] is large, the last in
    none."""
    gpt_oss = routing == GPT_OSS
    if gpt_oss:
        layer = SparseMoE(hidden, experts, inter, Routing(ACTIVE, TOPK_SOFTMAX), act="swiglu_clamped",
                          router_bias=True, expert_bias=True, act_params={"alpha": 1.702, "limit": 7.0})
    else:
        layer = SparseMoE(hidden, experts, inter, Routing(ACTIVE, *routing))
    router = torch.randn(experts, hidden) * 0.3
    router[:, 0] = torch.tensor([10.0] + [0.0] * (experts - 2) + [-10.0])
    layer.gate.load([router.bfloat16()], torch.randn(experts) * 0.1 if gpt_oss else None, "gate")
    for e, expert in enumerate(layer.experts):
        for proj, shape in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            w = _expert_weight(kind, shape, seed=10 * e + len(proj))
            bias = torch.randn(shape[0]) * 6 if gpt_oss else None  # gate/up beyond the clamps at +-7 now and then
            getattr(expert, proj).load([w], bias, f"experts.{e}.{proj}")
    ctx = LoadContext(torch.bfloat16, native, kernels.cpu_has_native_bf16())
    for m in layer.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading(ctx)
    return layer


@pytest.mark.skipif(native is None, reason="native kernels could not be built here")
@pytest.mark.parametrize(
    "kind, routing",
    [("bf16", (SOFTMAX_TOPK, True)), ("Q8_0", (TOPK_SOFTMAX, False)), ("Q4_K", (SOFTMAX_TOPK, True)),
     ("Q6_K", (SOFTMAX_TOPK, False)), ("MXFP4", GPT_OSS), ("MXFP4 interleaved", GPT_OSS), ("Q8_0", GPT_OSS),
     ("bf16", GPT_OSS)],
)
def test_one_native_call_matches_the_python_loop(kind, routing):
    """Every expert of a bf16 step in one native call, against the experts' modules called one by one: the same
    bits, bf16 and quantized experts alike (gpt-oss's too: MXFP4 blocks, biases, the clamped SwiGLU), with an expert
    that takes every row and one that takes none; and the whole layer (router, routing, experts, residual add) in
    one call against routing in Python and the loop."""
    from waferscale.models.layers.moe import GroupedExperts

    torch.manual_seed(5)
    hidden, inter, experts = 256, 256, 8
    gpt_oss = routing == GPT_OSS
    layer = _native_layer(kind, routing)
    method = layer.experts.method
    assert isinstance(method, NativeExperts) and isinstance(method.fallback, GroupedExperts)
    assert layer.native_weights() is not None
    if gpt_oss:  # the clamps matter
        gate, up = layer.experts[0].gate_up_proj(torch.randn(16, hidden).bfloat16()).split(inter, dim=-1)
        assert (gate > 7).any() and (up.abs() > 7).any()
    for rows in (1, 3, 8, 16):
        x = torch.randn(rows, hidden).bfloat16()
        x[:, 0] = 4.0
        logits = layer.gate(x)
        weights, ids = layer.routing.route(logits)
        # among equal logits the native routing takes the lower id first (torch.topk has no such rule); the weights
        # at equal logits are equal
        ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :ACTIVE].contiguous()
        assert (ids == 0).any(-1).all() and not (ids == experts - 1).any()
        assert rows < 8 or len(ids.unique()) >= 4
        weights = weights.bfloat16()
        got, want = method.apply(x, ids, weights), method.fallback.apply(x, ids, weights)
        assert torch.equal(got, want), rows
        residual = (torch.randn(rows, hidden) * want.abs().mean()).bfloat16()  # as large as the experts' output
        before = layer.expert_load.clone()
        whole = layer(x, residual=residual)  # the router, routing and experts natively, in one call
        assert torch.equal(layer.expert_load - before, torch.bincount(ids.view(-1), minlength=experts))
        # the routing weights' float32 softmax may differ from torch's in a last bit, and so their bf16 rounding
        ref = (residual + want.bfloat16()).float()
        assert ((whole.float() - ref).abs() <= 2**-7 * (ref.abs() + want.abs()) + 1e-30).all(), rows


@pytest.mark.skipif(native is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_step_verifying_drafts_gives_every_thread_of_the_experts_call_the_one_row_paths(kind):
    """In a step that verifies drafts (rows_exact) a quantized expert's rows take the paths that give each row its
    one-row bits (Q4_1: gemm_i4m up to 11 rows; Q8_0: gemm_q8) on every thread of the one native call, as the
    experts' modules called one by one on the engine's thread do: an expert of 9 rows gives the same bits both ways
    (the call's other threads had taken the batch paths, gemm_i16b from 8 rows)."""
    torch.manual_seed(6)
    layer = _native_layer(kind, (SOFTMAX_TOPK, True))  # expert 0 takes every row
    method = layer.experts.method
    assert isinstance(method, NativeExperts)
    x = torch.randn(9, 256).bfloat16()
    x[:, 0] = 4.0
    logits = layer.gate(x)
    weights, _ = layer.routing.route(logits)
    ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :ACTIVE].contiguous()
    assert (ids == 0).any(-1).all()
    with native.rows_exact():
        got, want = method.apply(x, ids, weights.bfloat16()), method.fallback.apply(x, ids, weights.bfloat16())
    assert torch.equal(got, want)


# ---------------------------------------------------------------- the family from a folder


@pytest.mark.parametrize("length", [6, 60, 280])
def test_greedy_tokens_and_logprobs_match_transformers(qwen3_moe, length):
    ref, _, ours = qwen3_moe
    ids = _prompt(length)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


def test_experts_are_used_unevenly_and_loaded_per_expert(qwen3_moe):
    """The fixture exercises routing: tokens of one prompt reach several experts, and each expert holds its own
    checkpoint weights (per-expert tensors as transformers saved them)."""
    from safetensors import safe_open

    _, folder, ours = qwen3_moe
    layer = ours.model.layers[0].mlp
    x = ours.model.embed_tokens(torch.tensor(_prompt(60)))
    _, ids = layer.routing.route(layer.gate(ours.model.layers[0].post_attention_layernorm(x)))
    assert len(ids.unique()) >= 4
    assert not isinstance(ours.model.layers[1].mlp, SparseMoE)  # mlp_only_layers
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        down = f.get_tensor("model.layers.2.mlp.experts.5.down_proj.weight")
    assert torch.equal(ours.model.layers[2].mlp.experts[5].down_proj.weight, down)


def test_expert_load_counts_every_routed_row(qwen3_moe):
    """Each sparse layer counts the rows routed to each expert: k a token, prompt and generated tokens alike."""
    _, _, ours = qwen3_moe
    before = ours.model.expert_load()
    assert sorted(before) == [0, 2]  # layer 1 is dense
    ids = _prompt(30)
    _ours(ours, [ids])  # 30 prompt rows, then NEW_TOKENS - 1 decode rows (the last token is not run)
    after = ours.model.expert_load()
    for layer in (0, 2):
        added = [b - a for a, b in zip(before[layer], after[layer])]
        assert sum(added) == ACTIVE * (len(ids) + NEW_TOKENS - 1)
        assert max(added) < sum(added) // ACTIVE + 1  # no expert is counted twice for one row


def test_a_sequence_decodes_the_same_alone_and_among_15_others(qwen3_moe):
    _, _, ours = qwen3_moe
    target = _prompt(60)
    others = [_prompt(20 + 7 * i) for i in range(15)]
    alone = _ours(ours, [target])[0]
    together = _ours(ours, [target, *others])[0]
    assert together[0] == alone[0]
    assert max(abs(a - b) for a, b in zip(together[1], alone[1])) < 1e-5


@pytest.mark.skipif(native is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_decode_step_runs_each_sparse_layer_as_one_native_call_bit_for_bit(qwen3_moe, quantization):
    """At bf16 (experts packed, or quantized in int4), a decode-only batch runs each layer, its experts included, as
    one native call (and every layer in one): the same hidden states and stored keys and values, bit for bit, as the
    layer's modules; each routed row counted once in the expert load, by each of the three paths."""
    from test_kernels import whole_layer_against_modules

    _, folder, _ = qwen3_moe
    loaded = load_model(folder, dtype="bfloat16", quantization=quantization, progress=False)
    model = loaded.model
    sparse = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(model.decode_layers[i].moe is not None for i in sparse)
    before = model.expert_load()
    whole_layer_against_modules(model, loaded.config, torch.tensor([1, 16, 17, 90]))
    after = model.expert_load()
    for i in sparse:
        assert sum(after[i]) - sum(before[i]) == 3 * 4 * ACTIVE  # 4 rows, k each, once a path


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_folder_quantized_at_load_serves_experts_from_blocks(qwen3_moe, tmp_path, monkeypatch, method):
    """--quantization int8|int4 on a folder quantizes every expert's projections (the router stays float), and the
    logits stay close to the float model's."""
    from test_models import our_logits

    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    _, folder, exact = qwen3_moe
    served = load_model(folder, dtype="float32", quantization=method, progress=False)
    layer = served.model.layers[0].mlp
    assert all(p.quant is not None for e in layer.experts for p in (e.gate_up_proj, e.down_proj))
    assert layer.gate.quant is None
    ids = _prompt(40)
    got, want = our_logits(served, ids), our_logits(exact, ids)
    assert ((got - want).norm() / want.norm()) < (0.03 if method == "int8" else 0.25)  # 0.014 and 0.17 here


# ---------------------------------------------------------------- GGUF qwen3moe


def _write_qwen3moe_gguf(path, state: dict[str, torch.Tensor], cfg, experts_kind: str | None = None) -> None:
    """A qwen3moe GGUF of a transformers state dict: experts stacked [E, N, K] per projection (F32, or random
    blocks of `experts_kind`), the rest F32, the built-in model's tokenizer."""
    writer = moe_writer(path, "qwen3moe", cfg, experts=cfg.num_experts, expert_ffn=cfg.moe_intermediate_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}

    writer.add_tensor("token_embd.weight", f32(state["model.embed_tokens.weight"]))
    seed = 100
    for i in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", f32(state[f"model.layers.{i}.{hf}.weight"]))
        for proj, kind in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = np.stack([f32(state[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"])
                                for j in range(cfg.num_experts)])
            if experts_kind is None:
                writer.add_tensor(f"blk.{i}.{kind}.weight", stacked)
            else:
                seed += 1
                e, n, k = stacked.shape
                blocks = random_blocks(experts_kind, e * n, k, seed).reshape(e, n, -1)
                writer.add_tensor(f"blk.{i}.{kind}.weight", blocks,
                                  raw_dtype=getattr(gguf.GGMLQuantizationType, experts_kind))
    finish(writer, state)


def _per_expert_state(ref) -> dict[str, torch.Tensor]:
    """transformers' state dict with its fused experts as per-expert tensors (as save_pretrained writes them)."""
    from waferscale.models.layers.moe import split_stacked_experts

    state = dict(ref.state_dict())
    split_stacked_experts(state, ref.config.num_experts)
    return state


def test_gguf_of_transformers_weights_matches_transformers(qwen3_moe, tmp_path, monkeypatch):
    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    cfg = _qwen3_moe_config(mlp_only_layers=[])  # llama.cpp's qwen3moe: every layer sparse
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(ref)
    path = tmp_path / "tiny-moe.gguf"
    _write_qwen3moe_gguf(path, _per_expert_state(ref), cfg)
    ours = load_model(path, dtype="float32", progress=False)
    assert ours.config.architecture == "qwen3moe" and ours.config.num_experts == EXPERTS
    ids = _prompt(60)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_quantized_gguf_experts_load_from_their_blocks(tmp_path, monkeypatch, kind):
    """Stacked quantized experts are served from their blocks, each expert's down_proj a view of the stack's
    rows; the logits track the same file dequantized to bf16."""
    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    from test_models import our_logits
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    cfg = _qwen3_moe_config(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2, mlp_only_layers=[])
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(ref)
    path = tmp_path / f"tiny-moe.{kind}.gguf"
    _write_qwen3moe_gguf(path, _per_expert_state(ref), cfg, experts_kind=kind)
    monkeypatch.setattr(quant.modules, "ACT_MODE", quant.ACTIVATION_MODES["float32"])  # activations not rounded
    served = load_model(path, dtype="bfloat16", quantization="auto", progress=False)
    assert served.quantization == "gguf"
    experts = served.model.layers[0].mlp.experts
    assert all(p.quant is not None and p.weight is None for e in experts for p in (e.gate_up_proj, e.down_proj))
    if native is not None:  # a decode step's experts in one native call
        assert isinstance(experts.method, NativeExperts)
    downs = [e.down_proj.quant.parts[0].qweight for e in experts]
    assert len({d.untyped_storage().data_ptr() for d in downs}) == 1  # views of one stacked tensor
    gate_ups = [e.gate_up_proj.quant.parts for e in experts]  # gate and up stacked as one by the conversion
    assert all(len(p) == 1 for p in gate_ups)
    assert len({p[0].qweight.untyped_storage().data_ptr() for p in gate_ups}) == 1
    ids = served.tokenizer.encode("Hello there, how are you")
    (tokens, _), = _ours(served, [ids])
    assert len(tokens) == 8
    dense = load_model(path, dtype="bfloat16", quantization="none", progress=False)  # the same values, bf16
    got, want = our_logits(served, ids), our_logits(dense, ids)
    assert ((got - want).norm() / want.norm()) < 0.02


def test_a_model_with_qwen3_30b_a3b_routing_prefills_1024_tokens_a_step_unless_told(tmp_path, hf_tokenizer):
    from transformers import AutoModelForCausalLM

    from waferscale.engine import LLMEngine

    cfg = _qwen3_moe_config(num_experts=128, num_experts_per_tok=8, hidden_size=16, head_dim=8,
                            moe_intermediate_size=8, intermediate_size=16, num_hidden_layers=1, mlp_only_layers=[])
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path, safe_serialization=True)
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    assert LLMEngine(loaded, kv_cache_bytes=1 << 20).scheduler.max_num_batched_tokens == 1024
    told = LLMEngine(loaded, kv_cache_bytes=1 << 20, max_num_batched_tokens=256)
    assert told.scheduler.max_num_batched_tokens == 256


def test_a_model_that_does_not_fit_is_refused_before_loading(qwen3_moe, tmp_path, monkeypatch):
    """A folder, and a GGUF before its conversion, are refused with the memory their weights need."""
    from transformers import AutoModelForCausalLM

    from waferscale.models import ModelLoadError, loader

    _, folder, _ = qwen3_moe
    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    need = sum(s.stat().st_size for s in folder.glob("*.safetensors"))
    monkeypatch.setattr(loader, "_available_memory", lambda: need - 1)
    with pytest.raises(ModelLoadError, match=r"needs 0\.\d GiB of memory for its weights"):
        load_model(folder, dtype="float32", progress=False)
    monkeypatch.setattr(loader, "_available_memory", lambda: need + (1 << 20))
    assert load_model(folder, dtype="float32", progress=False).config.num_experts == EXPERTS
    path = tmp_path / "tiny-moe.gguf"
    cfg = _qwen3_moe_config(mlp_only_layers=[])
    _write_qwen3moe_gguf(path, _per_expert_state(AutoModelForCausalLM.from_config(cfg)), cfg)
    monkeypatch.setattr(loader, "_available_memory", lambda: 1 << 20)
    with pytest.raises(ModelLoadError, match="GiB of memory for its weights"):
        load_model(path, dtype="float32", progress=False)
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())


def test_a_gguf_whose_conversion_does_not_fit_on_disk_is_refused_before_writing(tmp_path, monkeypatch):
    """A GGUF's conversion that the cache's disk cannot hold is refused with the space it needs, nothing written."""
    from collections import namedtuple

    from transformers import AutoModelForCausalLM

    from waferscale.models import ModelLoadError, loader

    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-moe.gguf"
    cfg = _qwen3_moe_config(mlp_only_layers=[])
    _write_qwen3moe_gguf(path, _per_expert_state(AutoModelForCausalLM.from_config(cfg)), cfg)
    usage = namedtuple("usage", "total used free")
    disk_usage = loader.shutil.disk_usage
    monkeypatch.setattr(loader.shutil, "disk_usage", lambda where: usage(1 << 40, 1 << 40, 4096))
    with pytest.raises(ModelLoadError, match=r"writes about [\d.]+ MB to .*, which has 0\.0 MB free: free disk space"):
        load_model(path, dtype="float32", progress=False)
    assert not any((tmp_path / "cache" / "converted").iterdir())
    monkeypatch.setattr(loader.shutil, "disk_usage", disk_usage)
    assert load_model(path, dtype="float32", progress=False).config.num_experts == EXPERTS


# ---------------------------------------------------------------- served through the SDK


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_served_through_the_cerebras_sdk_from_a_folder_and_a_gguf(qwen3_moe, hf_tokenizer, tmp_path, source):
    """`waferscale serve --model` on a Qwen3-MoE folder and on a qwen3moe GGUF: a greedy completion through the
    official SDK is transformers' greedy continuation."""
    from conftest import Server, cerebras_for, fresh_cache
    from transformers import AutoModelForCausalLM

    if source == "folder":
        ref, path, _ = qwen3_moe
    else:
        torch.manual_seed(3)
        cfg = _qwen3_moe_config(mlp_only_layers=[])
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        _randomize(ref)
        path = tmp_path / "tiny-moe.gguf"
        _write_qwen3moe_gguf(path, _per_expert_state(ref), cfg)
    ids = _prompt(20)
    want_tokens, _ = _theirs(ref, ids)
    server = Server("--model", str(path), "--served-model-name", "tiny-moe", "--dtype", "float32",
                    "--kv-cache-memory", "32MiB", "--speculative", "none",
                    env={"WAFERSCALE_CACHE_DIR": str(fresh_cache(tmp_path / "cache"))})
    try:
        with cerebras_for(server.url) as client:
            out = client.completions.create(
                model="tiny-moe", prompt=ids, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0
            )
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert out.choices[0].text == hf_tokenizer.decode(want_tokens)
    assert out.usage.completion_tokens == NEW_TOKENS
    # /metrics: tokens routed to each expert, summed per layer over every forward row (prompt and
    # generated; no speculation, whose rejected drafts are routed rows too)
    routed = {}
    for line in metrics.splitlines():
        if line.startswith("waferscale_expert_routed_tokens_total{"):
            labels, value = line.split("} ")
            layer = int(labels.split('layer="')[1].split('"')[0])
            routed[layer] = routed.get(layer, 0) + float(value)
    sparse = [0, 2] if source == "folder" else [0, 1, 2]
    assert sorted(routed) == sparse
    rows = len(ids) + NEW_TOKENS - 1  # the last token is sampled, never fed back
    assert all(total == rows * ACTIVE for total in routed.values()), routed
