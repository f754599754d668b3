"""gpt-oss against transformers at float32: a tiny random gpt-oss folder made by transformers here (sliding window
shorter than the longer prompts, non-zero sinks, YaRN rope, routers and expert biases large enough that routing
and the SwiGLU clamps matter) gives the same greedy tokens and logprobs within 5e-3 on prompts of 6, 60 and 280
tokens; the same model saved in the released MXFP4 layout (`*_blocks`, `*_scales`) too, against transformers on
the dequantized weights; and served from its blocks in bf16, close to the float model."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import f32, finish, moe_writer
from test_families import _ours, _prompt, _theirs

from waferscale import kernels
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


def _make(tmp_path_factory, hf_tokenizer, seed: int, name: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(_gpt_oss_config(**overrides), dtype=torch.float32).eval()
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


def test_config_json_of_the_released_checkpoint_is_read():
    """openai/gpt-oss-20b's config.json keys (rope_scaling beside rope_theta, experts_per_token, no layer_types
    or attention_bias, a quantization_config): windows on even layers, biases, YaRN untruncated."""
    from waferscale.models.config import ModelConfig

    raw = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "experts_per_token": 4, "sliding_window": 128, "vocab_size": 201088,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000, "swiglu_limit": 7.0,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "quantization_config": {"quant_method": "mxfp4"}, "tie_word_embeddings": False,
    }
    cfg = ModelConfig.from_hf(raw, "gpt-oss-20b")
    assert cfg.family == "gpt_oss" and cfg.attention_bias and cfg.num_experts_per_tok == 4
    assert cfg.moe_intermediate_size == 2880 and cfg.rope_theta == 150000
    assert [cfg.window(i) for i in range(4)] == [128, None, 128, None] and cfg.window(23) is None
    assert cfg.rope_scaling["truncate"] is False and cfg.rope_scaling["factor"] == 32.0


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


# ---------------------------------------------------------------- MXFP4 blocks


def _reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization of released-layout blocks [..., G, 16] (integrations/mxfp4.py), [..., G * 32]."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo, hi = lut[(blocks & 15).long()], lut[(blocks >> 4).long()]
    out = torch.stack([lo, hi], dim=-1).flatten(-2)  # byte j: weights 2j, 2j + 1
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2)


def _random_blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (n, k // 32), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[-1, -1] = 1, 0  # subnormal scales too (2^-126, 2^-127)
    return blocks, scales


def test_mxfp4_layout_dequantizes_as_transformers():
    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    blocks, scales = _random_blocks(24, 96, seed=1)
    w = Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)
    assert torch.equal(w.dequantize(), _reference_mxfp4(blocks, scales))
    assert torch.equal(w.take_rows(slice(1, None, 2)).dequantize(), _reference_mxfp4(blocks, scales)[1::2])


def test_mxfp4_quantizer_round_trips_in_both_nibble_orders():
    """quantize_mxfp4 (the tests' reference quantizer) picks values the layout gives back, in either order."""
    from waferscale.models.quant.mxfp4 import quantize_mxfp4

    w = torch.randn(16, 128) * 0.1
    a, b = quantize_mxfp4(w, interleaved=True), quantize_mxfp4(w, interleaved=False)
    assert torch.equal(a.dequantize(), b.dequantize())
    assert ((a.dequantize() - w).norm() / w.norm()) < 0.2  # 4-bit floats: about 10% error
    assert torch.equal(quantize_mxfp4(a.dequantize(), interleaved=True).dequantize(), a.dequantize())


def _kernels_built(monkeypatch, mode: str):
    """The native kernels as WAFERSCALE_NATIVE_KERNELS builds them for `mode` (native, portable, avx2), loaded
    afresh for this test; skips where they cannot be built."""
    monkeypatch.setenv("WAFERSCALE_NATIVE_KERNELS", "1" if mode == "native" else mode)
    monkeypatch.setattr(kernels, "_loaded", {})
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels could not be built here")
    return native


@pytest.mark.parametrize("mode", ["native", "portable"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mxfp4_kernel_matches_a_float_reference(tmp_path, monkeypatch, mode, interleaved):
    """The native kernel on random blocks against the same weights dequantized, for 1 row (a decode step's dot
    product), 3, 8 and 37 rows, with a bias and as columns of a wider output; the AVX2 build and the plain-C one
    (WAFERSCALE_NATIVE_KERNELS=portable, as on a CPU without AVX2)."""
    from waferscale.models.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4

    native = _kernels_built(monkeypatch, mode)
    blocks, scales = _random_blocks(40, 256, seed=2)
    w = Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)
    if not interleaved:  # the same values in GGUF's nibble order
        w = quantize_mxfp4(w.dequantize(), interleaved=False)
        assert torch.equal(w.dequantize(), _reference_mxfp4(blocks, scales))
    dense = _reference_mxfp4(blocks, scales).double()
    bias = torch.randn(40)
    for rows in (1, 3, 8, 37):
        x = torch.randn(rows, 256)
        out = torch.full((rows, 50), 7.0)
        native.mxfp4_gemm(x, w, out[:, 5:45], bias, act=0)
        want = (x.double() @ dense.T + bias.double()).float()
        torch.testing.assert_close(out[:, 5:45], want, rtol=1e-5, atol=1e-4)
        assert (out[:, :5] == 7).all() and (out[:, 45:] == 7).all()


@pytest.mark.parametrize("mode", ["native", "avx2"])
def test_mxfp4_int8_batches_give_the_row_paths_products(monkeypatch, mode):
    """With int8 activations (per 32), batches from 16 rows go to the int8 tiles or vectors (AMX, AVX-512 VNNI or
    AVX2, the e2m1 values widened through a table): 37 rows against 40 weight rows (two 16-row tasks and 8 past
    them) give each row what the one-row kernel gives it (the same integer products, summed in another order)."""
    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    native = _kernels_built(monkeypatch, mode)
    blocks, scales = _random_blocks(40, 256, seed=3)
    w = Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)
    x, bias = torch.randn(37, 256, generator=torch.Generator().manual_seed(4)), torch.randn(40)
    batch = torch.empty(37, 40)
    native.mxfp4_gemm(x, w, batch, bias, act=1)
    for r in (0, 15, 16, 36):
        one = torch.empty(1, 40)
        native.mxfp4_gemm(x[r : r + 1].contiguous(), w, one, bias, act=1)
        assert ((one[0] - batch[r]).norm() / one[0].norm()) < 1e-5, r
    want = x.double() @ _reference_mxfp4(blocks, scales).double().T + bias.double()
    assert ((batch.double() - want).norm() / want.norm()) < 0.03  # and int8 activations stay close


def _save_as_mxfp4(ref, folder) -> None:
    """Rewrite a saved folder's experts in the released layout (`*_blocks` [E, N, K / 32, 16], `*_scales`
    [E, N, K / 32], rows as the checkpoints order them: gate/up interleaved), and set transformers' experts to the
    dequantized values, so that both sides hold the same weights."""
    from safetensors.torch import load_file, save_file

    from waferscale.models.quant.mxfp4 import quantize_mxfp4

    path = next(folder.glob("*.safetensors"))
    state = load_file(str(path))
    for i, layer in enumerate(ref.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # [E, K, N]
            blocks, scales, values = [], [], []
            for e in range(param.shape[0]):
                w = quantize_mxfp4(param[e].detach().T, interleaved=True)  # [N, K]: N the outputs
                blocks.append(w.qweight.view(w.out_features, -1, 16))
                scales.append(w.scales)
                values.append(w.dequantize().T)
            with torch.no_grad():
                param.copy_(torch.stack(values))
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = torch.stack(blocks), torch.stack(scales)
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, hf_tokenizer):
    """(transformers' tiny random gpt-oss with MXFP4-rounded experts, its folder in the released MXFP4 layout);
    the SwiGLU limit the released one's (GGUF files do not carry it: llama.cpp fixes it at 7)."""
    ref, folder = _make(tmp_path_factory, hf_tokenizer, 1, "gpt-oss-mxfp4", swiglu_limit=7.0)
    _save_as_mxfp4(ref, folder)
    return ref, folder


@pytest.fixture(scope="module")
def gpt_oss_dequantized(gpt_oss_mxfp4, tmp_path_factory, hf_tokenizer):
    """The same model with its experts' MXFP4 values stored as float (transformers' layout)."""
    ref, _ = gpt_oss_mxfp4
    folder = tmp_path_factory.mktemp("gpt-oss-dequantized")
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    return folder


def test_mxfp4_checkpoint_at_float32_matches_transformers(gpt_oss_mxfp4):
    """The float32 exact path dequantizes the blocks: the same tokens as transformers on the same values."""
    ref, folder = gpt_oss_mxfp4
    ours = _loaded(folder, "float32")
    ids = _prompt(280)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


_LOADED: dict = {}


def _loaded(folder, dtype: str):
    key = (str(folder), dtype)
    if key not in _LOADED:
        _LOADED[key] = load_model(folder, dtype=dtype, progress=False)
    return _LOADED[key]


def test_mxfp4_experts_are_served_from_their_blocks_in_bf16(gpt_oss_mxfp4, gpt_oss_dequantized, monkeypatch):
    """In bf16 the experts keep their blocks (no float weight beside them); a sparse layer's output tracks the
    float32 one's (activations rounded to int8 per block, the default); with float32 activations the logits are
    as close to float32's as those of the same values held as bf16 weights."""
    from test_models import our_logits

    from waferscale.models import quant
    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    _, folder = gpt_oss_mxfp4
    served, exact = _loaded(folder, "bfloat16"), _loaded(folder, "float32")
    assert served.quantization == "quantized"
    for layer in served.model.layers:
        for expert in layer.mlp.experts:
            for proj in (expert.gate_up_proj, expert.down_proj):
                assert proj.weight is None and isinstance(proj.quant, QuantLinear)
                assert all(isinstance(p, Mxfp4Weight) for p in proj.quant.parts)
    blocks = served.model.layers[0].mlp.experts[0].gate_up_proj.quant.parts[0]
    assert blocks.nbytes() == 2 * 64 * (64 // 2 + 64 // 32)  # 17 bytes a block of 32: 0.53 bytes a weight
    x = torch.randn(40, 64)
    got, want = served.model.layers[0].mlp(x.bfloat16()).float(), exact.model.layers[0].mlp(x)
    assert ((got - want).norm() / want.norm()) < 0.02  # bf16 and int8 activations
    monkeypatch.setattr(quant.modules, "ACT_MODE", quant.ACTIVATION_MODES["float32"])
    served = load_model(folder, dtype="bfloat16", progress=False)  # the experts' calls take the mode at loading
    ids = _prompt(60)
    dense = _loaded(gpt_oss_dequantized, "bfloat16")
    assert dense.model.layers[0].mlp.experts[0].down_proj.quant is None
    got, held, want = our_logits(served, ids), our_logits(dense, ids), our_logits(exact, ids)
    # the experts' native calls round the clamped SwiGLU once, PyTorch's bf16 ops at each step: as close to float32
    assert ((got - want).norm() / want.norm()) < 1.1 * ((held - want).norm() / want.norm())
    (tokens, _), = _ours(served, [ids])
    assert len(tokens) == 8


@pytest.mark.skipif(kernels.load() is None, reason="native kernels could not be built here")
@pytest.mark.parametrize("source, quantization", [("mxfp4", "auto"), ("dequantized", "int4")])
def test_a_decode_step_runs_each_layer_as_one_native_call_bit_for_bit(
    gpt_oss_mxfp4, gpt_oss_dequantized, source, quantization
):
    """At bf16, with MXFP4 experts, or packed bf16 experts beside attention quantized at load, a decode-only batch
    runs each layer (sinks, the output bias, the window, the router's and experts' biases, the clamped SwiGLU) as
    one native call: the same hidden states and stored keys and values, bit for bit, as the layer's modules; rows
    past the window."""
    from test_kernels import whole_layer_against_modules

    folder = gpt_oss_mxfp4[1] if source == "mxfp4" else gpt_oss_dequantized
    loaded = load_model(folder, dtype="bfloat16", quantization=quantization, progress=False)
    layers = loaded.model.decode_layers
    assert layers is not None and all(w.moe is not None and w.sinks is not None and w.o_bias is not None
                                      for w in layers)
    whole_layer_against_modules(loaded.model, loaded.config, torch.tensor([1, 16, WINDOW + 3, 90]))


def test_mxfp4_without_native_kernels_dequantizes_a_tile_at_a_time():
    """Where the kernels cannot be built, PyTorch multiplies the blocks a tile at a time (no float copy kept)."""
    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    blocks, scales = _random_blocks(40, 256, seed=3)
    layer = QuantLinear([Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)], torch.randn(40))
    assert layer.native is None
    x = torch.randn(5, 256)
    want = x.double() @ _reference_mxfp4(blocks, scales).double().T + layer.bias.double()
    torch.testing.assert_close(layer(x), want.float(), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- GGUF gpt-oss


def _write_gpt_oss_gguf(path, ref) -> None:
    """A `gpt-oss` GGUF as llama.cpp's convert_hf_to_gguf.py writes one, of transformers' model: gate and up split
    out of the interleaved stack, experts as MXFP4 blocks (type 39, GGUF's nibble order) with biases stacked
    [E, N]; the rest F32; YaRN and the window in the metadata; the built-in model's tokenizer."""
    from waferscale.models.quant.mxfp4 import quantize_mxfp4

    cfg = ref.config
    writer = moe_writer(path, "gpt-oss", cfg, experts=cfg.num_local_experts, expert_ffn=cfg.intermediate_size)
    rope = cfg.rope_parameters
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_sliding_window(cfg.sliding_window)

    def mxfp4(stack: torch.Tensor) -> np.ndarray:
        """[E, N, K] floats (MXFP4 values already) as GGUF MXFP4 rows: per block its e8m0 byte, then 16 bytes."""
        rows = []
        for w in stack:
            q = quantize_mxfp4(w, interleaved=False)
            assert torch.equal(q.dequantize(), w)
            rows.append(torch.cat([q.scales.unsqueeze(-1), q.qweight.view(w.shape[0], -1, 16)], -1).flatten(1))
        return torch.stack(rows).numpy()

    state = ref.state_dict()
    writer.add_tensor("token_embd.weight", f32(state["model.embed_tokens.weight"]))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}"
        for ours, theirs in names.items():
            for suffix in ("weight", "bias"):
                if f"{hf}.{ours}.{suffix}" in state:
                    writer.add_tensor(f"blk.{i}.{theirs}.{suffix}", f32(state[f"{hf}.{ours}.{suffix}"]))
        writer.add_tensor(f"blk.{i}.attn_sinks.weight", f32(state[f"{hf}.self_attn.sinks"]))
        gate_up = state[f"{hf}.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H]
        gate_up_bias = state[f"{hf}.mlp.experts.gate_up_proj_bias"]
        stacks = {"ffn_gate_exps": (gate_up[:, 0::2], gate_up_bias[:, 0::2]),
                  "ffn_up_exps": (gate_up[:, 1::2], gate_up_bias[:, 1::2]),
                  "ffn_down_exps": (state[f"{hf}.mlp.experts.down_proj"].transpose(1, 2),
                                    state[f"{hf}.mlp.experts.down_proj_bias"])}
        for name, (weight, bias) in stacks.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", mxfp4(weight), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(f"blk.{i}.{name}.bias", f32(bias))
    finish(writer, state)


@pytest.fixture(scope="module")
def gpt_oss_gguf(gpt_oss_mxfp4, tmp_path_factory):
    ref, _ = gpt_oss_mxfp4
    path = tmp_path_factory.mktemp("gpt-oss-gguf") / "tiny-gpt-oss.gguf"
    _write_gpt_oss_gguf(path, ref)
    return path


def test_gguf_at_float32_matches_transformers(gpt_oss_mxfp4, gpt_oss_gguf, tmp_path, monkeypatch):
    """llama.cpp's names, MXFP4 blocks (dequantized: the exact path), YaRN and the window read from the file."""
    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    ref, _ = gpt_oss_mxfp4
    ours = load_model(gpt_oss_gguf, dtype="float32", progress=False)
    cfg = ours.config
    assert cfg.family == "gpt_oss" and cfg.num_experts == EXPERTS and cfg.rope_scaling["truncate"] is False
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    ids = _prompt(60)
    (tokens, logprobs), = _ours(ours, [ids])
    want_tokens, want_logprobs = _theirs(ref, ids)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 5e-3


def test_gguf_mxfp4_experts_serve_as_the_folder_does(gpt_oss_mxfp4, gpt_oss_gguf, tmp_path, monkeypatch):
    """In bf16 the GGUF's experts are served from their MXFP4 blocks (GGUF's nibble order), with the tokens and
    logits of the same model's released-layout folder."""
    from test_models import our_logits

    from waferscale.models.quant.mxfp4 import Mxfp4Weight

    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    _, folder = gpt_oss_mxfp4
    served = load_model(gpt_oss_gguf, dtype="bfloat16", progress=False)
    assert served.quantization == "gguf"
    part = served.model.layers[1].mlp.experts[5].down_proj.quant.parts[0]
    assert isinstance(part, Mxfp4Weight) and not part.interleaved
    same = _loaded(folder, "bfloat16")
    ids = _prompt(60)
    assert _ours(served, [ids])[0][0] == _ours(same, [ids])[0][0]
    got, want = our_logits(served, ids), our_logits(same, ids)
    assert ((got - want).norm() / want.norm()) < 1e-3


@pytest.mark.parametrize("mode", ["native", "portable"])
def test_mxfp4_kernel_with_int8_activations_matches_its_reference(monkeypatch, mode):
    """With activations rounded to int8 per block of 32 (act=1, and the default auto), the kernel gives exactly
    the products of the rounded rows (summed in float32), in both builds and both nibble orders; 10 blocks a row,
    so that AVX-512's groups of 4 blocks leave 2 to the 256-bit steps."""
    from waferscale.models.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4

    native = _kernels_built(monkeypatch, mode)
    blocks, scales = _random_blocks(40, 320, seed=4)
    interleaved = Mxfp4Weight.from_blocks(blocks, scales, interleaved=True)
    gguf_order = quantize_mxfp4(interleaved.dequantize(), interleaved=False)
    dense = _reference_mxfp4(blocks, scales).double()
    for rows in (1, 5, 9, 37):  # 37: AMX tiles where there are (32 weight rows a task, the other 8 as below)
        x = torch.randn(rows, 320)
        x[0, :32] = 0  # an all-zero block
        d = x.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127
        rounded = (torch.round(x.view(rows, -1, 32) / torch.where(d == 0, 1, d)) * d).view(rows, 320)
        want = (rounded.double() @ dense.T).float()
        for w in (interleaved, gguf_order):
            for act in (1, 2):
                out = torch.empty(rows, 40)
                native.mxfp4_gemm(x, w, out, act=act)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
