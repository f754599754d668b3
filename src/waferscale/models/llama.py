"""Llama-family decoder (llama, mistral, qwen2) in plain PyTorch, with the same numerics as Hugging Face's."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.kernels import DecodeLayerWeights, pack_bf16, pack_bf16_pairs
from waferscale.models.config import ModelConfig
from waferscale.models.quant import ACT_MODE, QuantEmbedding, QuantLinear, QuantWeight, cat_rows

_UPCAST_ROWS = 64  # without float32 copies, batches this large are still worth upcasting on the fly
_F32_COPY_ROWS = 4  # with float32 copies, batches from this size use them
# where bf16 is multiplied in hardware, batches up to this many rows still take the native kernels: oneDNN's bf16
# GEMM costs about 12 ms a step for the built-in model at 1-8 rows (its small-batch path), the native one 5.5 ms at
# 1 row; with the whole-layer decode call, a decode step on the 2-core AMX machine is faster natively up to 16 rows
# (23.5 against 32.1 ms at 8, 36.3 against 38.2 at 16), and oneDNN (AMX) wins from 24 (44.3 against 47.7 ms)
HARDWARE_BF16_NATIVE_ROWS = 16


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN bf16 GEMM of `rows` rows is padded to: oneDNN (and ideep above it) builds and caches a
    primitive, with its JIT code and scratch, for every shape it meets, and continuous batching makes a new row count
    at almost every step, so a long-running server's caches grow to their caps (RSS up ~200 MB over thousands of
    requests on an AMX machine). Up to 128 rows: a multiple of 16; beyond: a multiple of 64 (at most ~1/3 extra
    rows, in the fast batch sizes)."""
    step = 16 if rows <= 128 else 64
    return -(-rows // step) * step


def _within(rows: int, limit: int | None) -> bool:
    """Whether a batch of `rows` rows is within a native path's row limit (None: no limit)."""
    return limit is None or rows <= limit


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 GEMMs are emulated."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True  # unknown platform: trust the library
    return "avx512_bf16" in flags or "amx_bf16" in flags


def release(module: nn.Module, name: str) -> None:
    """Drop a weight that a packed copy replaces, keeping its shape and dtype (on the meta device, no storage), so
    that memory holds one copy of the weights. A tied weight stays alive through the module it is tied to."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False))


class Linear(nn.Module):
    """y = x W^T (+ b), with uninitialised storage: the checkpoint fills it.

    On CPUs that emulate bf16 (no AVX512-BF16/AMX), PyTorch's bf16 GEMMs are slow, so bf16 weights take one of two
    faster paths: the native kernel on a packed copy (`use_native`, where the kernels could be built: it widens bf16
    to float32 in registers, so it reads half the bytes of a float32 copy), or else a float32 copy for batched rows
    (`make_f32_copy`) while single rows stay in bf16, where reading fewer bytes wins. Where bf16 is multiplied in
    hardware, only small batches take the native kernel (`native_rows`); larger ones go to PyTorch (oneDNN, AMX).
    float32 weights take the native kernel in place (no copy), for every batch: a row's numbers are then the same
    whatever else runs in its step (decode rows beside a prompt's, or a prediction's drafts), so greedy float32
    answers do not depend on the load. PyTorch would send them to MKL, whose float32 GEMMs are slow on AMD CPUs for
    small batches and give a row different bits at 1-2 rows than at more. scripts/bench_f32.py on a 2-core Zen 1
    EPYC, the built-in model's shapes, native over MKL's speed: 1.5-6.6x at 1-4 rows, 1.2-2.5x at 16, 0.6-1.4x at
    64, 0.80-0.87x at 512 (a long prompt's prefill, the one place it costs).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_f32: torch.Tensor | None = None
        self.bias_f32: torch.Tensor | None = None
        self.onednn_packed = False
        # waferscale.kernels.NativeKernels, and the weight in its GEMM's packed layout (see use_native)
        self.native = None
        self.weight_packed: torch.Tensor | None = None
        self.native_rows: int | None = None  # batches of at most this many rows use weight_packed (None: any)

    def takes_native(self, x: torch.Tensor) -> bool:
        """Whether x goes through the native kernel (bf16 rows on a packed weight, or float32 rows on a float32
        weight, in a batch it is faster for)."""
        if self.native is None or x.dim() != 2 or not _within(x.shape[0], self.native_rows):
            return False
        if self.weight_packed is not None:
            return x.dtype == torch.bfloat16
        return x.dtype == self.weight.dtype == torch.float32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), plus `residual` when given (the native kernel adds it in the same pass)."""
        if self.takes_native(x):
            if self.weight_packed is None:  # float32
                y = self.native.linear_f32(x, self.weight, self.bias)
                return y if residual is None else residual + y
            if residual is not None and residual.dtype == torch.bfloat16:
                return self.native.linear_add_bf16(
                    x, self.weight_packed, self.weight.shape[0], residual, self.bias_f32
                )
            y = self.native.linear_bf16(
                x, self.weight_packed, self.weight.shape[0], self.bias_f32, torch.bfloat16
            )
        else:
            y = self._project(x)
        return y if residual is None else residual + y

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and cpu_has_native_bf16()):
            rows = x.shape[0]
            if self.weight_f32 is not None and rows >= _F32_COPY_ROWS:
                return self.forward_f32(x.float()).to(x.dtype)
            if rows >= _UPCAST_ROWS:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        elif x.dtype == torch.bfloat16 and x.dim() == 2:  # oneDNN's bf16 GEMM: a few row counts only
            rows, padded = x.shape[0], onednn_rows(x.shape[0])
            if padded != rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
                return F.linear(x, self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)

    def use_native(self, kernels, max_rows: int | None = None) -> int:
        """Pack a bf16 weight for the native GEMM, used for batches up to max_rows rows (None: any); returns the
        bytes of the packed copy (0 for other dtypes). A float32 weight is used as it is, for every batch."""
        if self.weight.dtype == torch.float32:
            self.native, self.native_rows = kernels, None
            return 0
        if self.weight.dtype != torch.bfloat16:
            return 0
        self.native, self.native_rows = kernels, max_rows
        self.weight_packed = pack_bf16(self.weight.detach())
        if self.bias is not None:
            self.bias_f32 = self.bias.detach().float()
        if max_rows is None:  # every bf16 batch reads the packed copy: it is the only one kept
            release(self, "weight")
        return self.weight_packed.numel() * 2

    def make_f32_copy(self) -> int:
        """Build the float32 copy (packed for oneDNN where available); returns its size in bytes."""
        w = self.weight.detach().float().contiguous()
        self.bias_f32 = None if self.bias is None else self.bias.detach().float()
        self.onednn_packed = False
        if torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
                probe = torch.zeros(4, w.shape[1])
                torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias_f32, "none", [], "")
                w, self.onednn_packed = packed, True
            except (RuntimeError, AttributeError):  # an older or different build: plain float32 GEMMs
                pass
        self.weight_f32 = w
        return w.numel() * 4

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32) through the float32 copy: oneDNN's packed GEMM is the fastest float32 path on CPU."""
        if self.onednn_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_f32, self.bias_f32, "none", [], "")
        return F.linear(x, self.weight_f32, self.bias_f32)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.native = None  # waferscale.kernels.NativeKernels: bf16 rows are normalised in one native call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            return self.native.rmsnorm_bf16(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor, for the rope scaling types we support."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "freq_factors":  # GGUF rope_freqs tensor: per-dimension divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, computed as transformers does."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq, scale = rope_inv_freq(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = (inv_freq[:, None].float() @ pos[None, :]).T
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for these positions, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (the Hugging Face weight layout) on x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv,
        layer: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of x's rows, plus `residual` when given."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if qkv.dtype == torch.bfloat16 and kv.can_fuse_decode(t, self.head_dim):
            out = kv.attend_decode_fused(layer, qkv, rope, self.num_heads, self.scale)
            return self.o_proj(out, residual)
        heads = self.num_heads + self.num_kv_heads
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, heads, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = kv.attend(layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.q_size), residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.native = None  # waferscale.kernels.NativeKernels, with gate/up packed in pairs (see use_native)
        self.gate_up_pairs: torch.Tensor | None = None
        self.native_rows: int | None = None  # batches of at most this many rows use gate_up_pairs (None: any)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), plus `residual` when given."""
        if (
            self.gate_up_pairs is not None
            and x.dtype == torch.bfloat16
            and _within(x.shape[0], self.native_rows)
        ):
            act = self.native.linear_silu_mul_bf16(x, self.gate_up_pairs, self.inter)
        else:
            gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act, residual)

    def use_native(self, kernels, max_rows: int | None = None) -> int:
        """Pack bf16 gate/up in pairs of panels, so one native pass gives silu(gate) * up, for batches up to
        max_rows rows (None: any); returns the bytes packed (0 where the weights are not bf16 or the width is not a
        multiple of 16)."""
        weight = getattr(self.gate_up_proj, "weight", None)  # a QuantLinear has none
        if weight is None or weight.dtype != torch.bfloat16 or self.inter % 16:
            return 0
        self.native, self.native_rows = kernels, max_rows
        self.gate_up_pairs = pack_bf16_pairs(weight.detach())
        if max_rows is None:
            release(self.gate_up_proj, "weight")
        return self.gate_up_pairs.numel() * 2


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaForCausalLM(nn.Module):
    """Token ids in, hidden states out; `logits` turns chosen hidden rows into float32 vocabulary scores."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_positions, dtype)
        self.requires_grad_(False)
        # each layer's weights for the native whole-layer decode call, and the most rows it takes (see
        # use_native_kernels); None where the layers cannot run natively
        self.decode_layers: list[DecodeLayerWeights] | None = None
        self.decode_rows: int | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        if (
            self.decode_layers is not None
            and h.dtype == torch.bfloat16
            and _within(h.shape[0], self.decode_rows)
            and kv.can_fuse_decode(h.shape[0], self.cfg.head_dim)
        ):  # decode rows only: each layer is one native call, in place on h (the modules' kernels, bit for bit)
            attn = self.layers[0].self_attn
            for i, weights in enumerate(self.decode_layers):
                kv.decode_layer(i, h, rope, weights, attn.num_heads, attn.scale)
            return self.norm(h)
        for i, layer in enumerate(self.layers):
            h = layer.self_attn(layer.input_layernorm(h), rope, kv, i, residual=h)
            h = layer.mlp(layer.post_attention_layernorm(h), residual=h)
        return self.norm(h)

    def add_float32_copies(self) -> int:
        """Give every projection a float32 copy for batched rows; returns the bytes added (0 when not useful)."""
        if isinstance(self.lm_head, QuantLinear) or self.lm_head.weight.dtype == torch.float32:
            return 0
        if cpu_has_native_bf16():
            return 0
        return sum(
            m.make_f32_copy() for m in self.modules() if isinstance(m, Linear) and m.weight_f32 is None
        )

    def use_native_kernels(self, kernels, max_rows: int | None = None) -> int:
        """Hand bf16 RMSNorms, and bf16 projections (packed, for batches up to max_rows rows; None: any), to the
        native kernels (waferscale.kernels.load()); returns the bytes of packed weights added."""
        added = 0
        paired = set()  # gate/up projections the MLP packed in pairs: not packed a second time
        for m in self.modules():
            if isinstance(m, MLP):
                done = m.use_native(kernels, max_rows)
                if done:
                    added += done
                    paired.add(id(m.gate_up_proj))
        for m in self.modules():
            if isinstance(m, Linear) and id(m) not in paired:
                added += m.use_native(kernels, max_rows)
            elif isinstance(m, RMSNorm) and m.weight.dtype == torch.bfloat16:
                m.native = kernels
            elif isinstance(m, QuantLinear):
                m.native = kernels
        layers = [self._decode_weights(layer) for layer in self.layers]
        self.decode_layers = None if None in layers else layers
        self.decode_rows = max_rows
        return added

    @staticmethod
    def _decode_weights(layer: DecoderLayer) -> DecodeLayerWeights | None:
        """The layer's weights for the whole-layer decode call, or None where a part of it is not native. Each
        projection is bf16 packed (gate/up in pairs) or quantized (a QuantLinear's parts)."""
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.native is None for n in norms):
            return None

        def weight(m: nn.Module):
            if isinstance(m, QuantLinear):
                return m.parts if m.native is not None else None
            return m.weight_packed

        gate_up = mlp.gate_up_pairs
        if gate_up is None and isinstance(mlp.gate_up_proj, QuantLinear):
            gate_up = weight(mlp.gate_up_proj)
        projections = (attn.qkv_proj, attn.o_proj, mlp.down_proj)
        qkv, o, down = (weight(p) for p in projections)
        if any(w is None for w in (qkv, o, gate_up, down)):
            return None
        if any(p.bias is not None for p in (attn.o_proj, mlp.down_proj, mlp.gate_up_proj)):
            return None
        qkv_proj = attn.qkv_proj
        return DecodeLayerWeights(
            norm1=layer.input_layernorm.weight,
            qkv=qkv,
            qkv_bias=qkv_proj.bias if isinstance(qkv_proj, QuantLinear) else qkv_proj.bias_f32,
            o=o,
            norm2=layer.post_attention_layernorm.weight,
            gate_up=gate_up,
            inter=mlp.inter,
            down=down,
            eps=layer.input_layernorm.eps,
            act=ACT_MODE,
        )

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if isinstance(head, QuantLinear):
            return head.project(hidden)
        if head.weight_packed is not None and head.takes_native(hidden):  # bf16 weights, float32 scores, a row's
            return head.native.linear_bf16(hidden, head.weight_packed, head.weight.shape[0])  # the same in any batch
        if hidden.shape[0] >= _F32_COPY_ROWS and head.weight_f32 is not None:
            return head.forward_f32(hidden.float())
        return head(hidden).float()

    def load_hf_state(self, tensors: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype) -> None:
        """Take weights named as in Hugging Face checkpoints, fusing q/k/v and gate/up; a QuantWeight entry (see
        models/quant.py) makes its projection a QuantLinear (or the embeddings a QuantEmbedding), kept as it is."""

        def take(name: str) -> torch.Tensor | QuantWeight:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            value = tensors.pop(name)
            return value if isinstance(value, QuantWeight) else value.to(dtype)

        def put(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
            expected = tuple(getattr(module, attr).shape)
            if tuple(value.shape) != expected:
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {expected}")
            setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))

        def linear(owner: nn.Module, attr: str, names: list[str], name: str, bias: list[str] = ()) -> None:
            parts, old = [take(n) for n in names], getattr(owner, attr)
            b = torch.cat([take(n) for n in bias]) if bias else None
            if all(isinstance(p, torch.Tensor) for p in parts):
                put(old, "weight", torch.cat(parts) if len(parts) > 1 else parts[0], name)
                if b is not None:
                    put(old, "bias", b, name + ".bias")
                return
            if not all(isinstance(p, QuantWeight) for p in parts):  # a float part beside quantized ones: rare
                dense = [p.dequantize().to(dtype) if isinstance(p, QuantWeight) else p for p in parts]
                put(old, "weight", torch.cat(dense), name)
                if b is not None:
                    put(old, "bias", b, name + ".bias")
                return
            shape = (sum(p.out_features for p in parts), parts[0].in_features)
            if shape != tuple(old.weight.shape) or any(p.in_features != shape[1] for p in parts):
                raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(old.weight.shape)}")
            merged: list[QuantWeight] = []  # neighbours of one layout become one tensor
            for p in parts:
                if merged and merged[-1].layout == p.layout:
                    merged[-1] = cat_rows([merged[-1], p])
                else:
                    merged.append(p)
            setattr(owner, attr, QuantLinear(merged, b))

        embed = take("model.embed_tokens.weight")
        if isinstance(embed, QuantWeight):
            self.embed_tokens = QuantEmbedding(embed, dtype)
        else:
            put(self.embed_tokens, "weight", embed, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            qkv = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
            bias = [f"{p}self_attn.{n}_proj.bias" for n in "qkv"] if a.qkv_proj.bias is not None else []
            linear(a, "qkv_proj", qkv, p + "qkv", bias)
            linear(a, "o_proj", [p + "self_attn.o_proj.weight"], p + "self_attn.o_proj.weight")
            gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            linear(layer.mlp, "gate_up_proj", gate_up, p + "mlp.gate_up")
            linear(layer.mlp, "down_proj", [p + "mlp.down_proj.weight"], p + "mlp.down_proj.weight")
            put(layer.input_layernorm, "weight", take(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attention_layernorm,
                "weight",
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
        put(self.norm, "weight", take("model.norm.weight"), "model.norm.weight")
        if "lm_head.weight" in tensors and not self.cfg.tie_word_embeddings:
            linear(self, "lm_head", ["lm_head.weight"], "lm_head.weight")
        elif isinstance(embed, QuantWeight):
            self.lm_head = QuantLinear([embed])  # the same blocks: one copy
        else:
            self.lm_head.weight = self.embed_tokens.weight
