"""Linear layers: one module whose execution path is a method object chosen once after loading.

A checkpoint fills `weight` and `bias` (or hands a list of QuantWeight blocks); `process_weights_after_loading`
then picks, by one function (`choose_method`), from the weight's format, the dtype and the CPU, how the layer
multiplies: plain PyTorch, a float32 copy for batched rows, the native float32 kernel in place, bf16 panels packed
for the native kernel (up to a row limit where bf16 is multiplied in hardware), or the integer kernels on quantized
blocks. Each method exposes `apply(x, residual)`, `logits(x)` and the weight the fused decode-layer kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from waferscale.kernels import pack_bf16, pack_bf16_pairs
from waferscale.models.quant import QuantLinear, QuantWeight, cat_rows
from waferscale.models.quant.layouts import adjacent_rows

_UPCAST_ROWS = 64  # without float32 copies, batches this large are still worth upcasting on the fly
_F32_COPY_ROWS = 4  # with float32 copies, batches from this size use them
# where bf16 is multiplied in hardware and the native kernels have no AMX tiles for it (LoadContext.native_rows),
# batches up to this many rows still take the native kernels: oneDNN's bf16
# GEMM is slow at a few rows (its small-batch path), and the whole-layer decode call wins up to 16 rows on the
# 2-core AMX machine (docs/quantization.md); oneDNN (AMX) wins from 24
HARDWARE_BF16_NATIVE_ROWS = 16


@dataclass(frozen=True)
class LoadContext:
    """What choosing an execution path depends on: the activation dtype, the native kernels (None: PyTorch ops),
    whether the CPU multiplies bf16 in hardware, and whether float32 copies of bf16 weights are affordable."""

    dtype: torch.dtype
    kernels: object | None
    hardware_bf16: bool
    float32_copies: bool = False

    @property
    def native_rows(self) -> int | None:
        """The most rows a batch may have to take the native bf16 kernels (None: any): where bf16 is multiplied in
        hardware, larger batches go to oneDNN, on a row-major copy kept beside the packed one, unless the native
        kernels multiply large batches on AMX tiles themselves."""
        if not self.hardware_bf16:
            return None
        tiles = getattr(self.kernels, "bf16_tiles", None)
        return None if tiles is not None and tiles() else HARDWARE_BF16_NATIVE_ROWS

    def packs_bf16(self) -> bool:
        """Whether bf16 weights are packed for the native kernels."""
        return self.dtype == torch.bfloat16 and self.kernels is not None


def within(rows: int, limit: int | None) -> bool:
    """Whether a batch of `rows` rows is within a native path's row limit (None: no limit)."""
    return limit is None or rows <= limit


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN bf16 GEMM of `rows` rows is padded to: oneDNN (and ideep above it) builds and caches a
    primitive, with its JIT code and scratch, for every shape it meets, and continuous batching makes a new row count
    at almost every step, so a long-running server's caches would grow to their caps. Up to 128 rows: a multiple of
    16; beyond: a multiple of 64 (at most ~1/3 extra rows, in the fast batch sizes)."""
    step = 16 if rows <= 128 else 64
    return -(-rows // step) * step


_PACK_CHUNK_BYTES = 1 << 24  # pack_bf16 makes three copies of what it packs: so many bytes of rows at a time


def pack_bf16_chunked(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """kernels.pack_bf16 (or, pairs, pack_bf16_pairs of a fused gate/up) of a [N, K] weight, the same panels, made a
    few MiB of rows at a time into the result: packing a large weight whole (a 150k-token head) held three
    transient copies of it beside the weight."""
    n, k = weight.shape
    rows = max(16, _PACK_CHUNK_BYTES // (2 * k) // 16 * 16)
    if n <= rows:
        return pack_bf16_pairs(weight) if pairs else pack_bf16(weight)
    if not pairs:
        out = torch.empty(-(-n // 16), k, 16, dtype=torch.bfloat16)
        for r in range(0, n, rows):
            part = pack_bf16(weight[r : r + rows])
            out[r // 16 : r // 16 + part.shape[0]] = part
        return out
    inter = n // 2  # gate rows then up rows; panel pairs (gate i, up i) in order
    out = torch.empty(n // 16, k, 16, dtype=torch.bfloat16)
    half = max(16, rows // 2)
    for r in range(0, inter, half):
        part = torch.cat([weight[r : r + half], weight[inter + r : inter + r + half]])
        part = pack_bf16_pairs(part)
        out[2 * r // 16 : 2 * r // 16 + part.shape[0]] = part
    return out


def _meta(t: torch.Tensor) -> nn.Parameter:
    """A stand-in with t's shape and dtype and no storage, for a weight that a packed copy replaces."""
    return nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False)


class LinearMethod:
    """How a Linear multiplies; built once after loading, then only applied."""

    def apply(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) in x's dtype, plus `residual` when given."""
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T as float32 scores (the language-model head)."""
        return self.apply(x).float()

    def decode_weight(self) -> torch.Tensor | list[QuantWeight] | None:
        """The weight as the whole-layer decode kernel reads it (packed bf16 panels or quantized parts), or None."""
        return None

    def decode_bias(self) -> torch.Tensor | None:
        """The float32 bias the whole-layer decode kernel adds, or None."""
        return None

    def nbytes(self) -> int:
        """Bytes this method added beside the checkpoint's weight (packed or float32 copies)."""
        return 0


class TorchMethod(LinearMethod):
    """PyTorch's GEMM on the weight as loaded. Where bf16 is emulated, large batches are upcast to float32 on the
    fly; where oneDNN multiplies bf16, batches are padded to a few row counts (see onednn_rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, hardware_bf16: bool):
        self.weight, self.bias, self.hardware_bf16 = weight, bias, hardware_bf16

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and self.hardware_bf16):
            if x.shape[0] >= _UPCAST_ROWS:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        elif x.dtype == torch.bfloat16 and x.dim() == 2:  # oneDNN's bf16 GEMM: a few row counts only
            rows, padded = x.shape[0], onednn_rows(x.shape[0])
            if padded != rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
                return F.linear(x, self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)

    def apply(self, x, residual=None):
        y = self.project(x)
        return y if residual is None else residual + y


class Float32CopyMethod(TorchMethod):
    """Where bf16 (or fp16) is emulated and the native kernels are missing: a float32 copy (packed for oneDNN where
    it can be) serves batches of 4 rows or more; single rows stay in the checkpoint's dtype, reading fewer bytes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, hardware_bf16: bool):
        super().__init__(weight, bias, hardware_bf16)
        w = weight.detach().float().contiguous()
        self.bias_f32 = None if bias is None else bias.detach().float()
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

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """float32 x through the float32 copy: oneDNN's packed GEMM is the fastest float32 path on CPU."""
        if self.onednn_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_f32, self.bias_f32, "none", [], "")
        return F.linear(x, self.weight_f32, self.bias_f32)

    def project(self, x):
        if x.dtype != torch.float32 and x.shape[0] >= _F32_COPY_ROWS:
            return self.forward_f32(x.float()).to(x.dtype)
        return super().project(x)

    def logits(self, x):
        if x.shape[0] >= _F32_COPY_ROWS:
            return self.forward_f32(x.float())
        return super().project(x).float()

    def nbytes(self):
        return self.weight_f32.numel() * 4


class NativeF32Method(LinearMethod):
    """float32 weights read in place by the native kernel, for every batch: a row's numbers are then the same
    whatever else runs in its step, and small batches avoid MKL's slow paths on AMD CPUs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels, hardware_bf16: bool):
        self.weight, self.bias, self.kernels = weight, bias, kernels
        self.fallback = TorchMethod(weight, bias, hardware_bf16)  # other dtypes and shapes

    def apply(self, x, residual=None):
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.fallback.apply(x, residual)
        y = self.kernels.linear_f32(x, self.weight, self.bias)
        return y if residual is None else residual + y


class PackedBF16Method(LinearMethod):
    """bf16 weights packed in panels for the native GEMM, which widens them in registers: batches up to `max_rows`
    rows (None: any); larger ones go to `fallback` (PyTorch on the weight as loaded)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels, max_rows: int | None, fallback):
        self.kernels, self.max_rows, self.fallback = kernels, max_rows, fallback
        self.out_features = weight.shape[0]
        self.packed = pack_bf16_chunked(weight.detach())
        self.bias_f32 = None if bias is None else bias.detach().float()

    def takes_native(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == torch.bfloat16 and within(x.shape[0], self.max_rows)

    def apply(self, x, residual=None):
        if not self.takes_native(x):
            return self.fallback.apply(x, residual)
        if residual is not None and residual.dtype == torch.bfloat16:
            return self.kernels.linear_add_bf16(x, self.packed, self.out_features, residual, self.bias_f32)
        y = self.kernels.linear_bf16(x, self.packed, self.out_features, self.bias_f32, torch.bfloat16)
        return y if residual is None else residual + y

    def logits(self, x):
        if self.takes_native(x):  # float32 scores, a row's the same in any batch
            return self.kernels.linear_bf16(x, self.packed, self.out_features)
        return self.fallback.logits(x)

    def decode_weight(self):
        return self.packed

    def decode_bias(self):
        return self.bias_f32

    def nbytes(self):
        return self.packed.numel() * 2


class QuantMethod(LinearMethod):
    """Quantized blocks multiplied by the integer kernels (models/quant/), never dequantized to a second copy."""

    def __init__(self, layer: QuantLinear):
        self.layer = layer

    def apply(self, x, residual=None):
        return self.layer(x, residual)

    def logits(self, x):
        return self.layer.project(x)

    def decode_weight(self):
        return self.layer.parts if self.layer.native is not None else None

    def decode_bias(self):
        return self.layer.bias


class Unpacked(LinearMethod):
    """A weight that a fused neighbour packed and released (gate/up in pairs): never multiplied on its own."""

    def apply(self, x, residual=None):
        raise RuntimeError("this projection's weight lives only in its fused neighbour's packed copy")


def choose_method(weight: torch.Tensor, bias: torch.Tensor | None, ctx: LoadContext) -> LinearMethod:
    """The one place a dense weight's execution path is chosen, from its dtype, the kernels and the CPU."""
    if weight.dtype == torch.float32 and ctx.kernels is not None:
        return NativeF32Method(weight, bias, ctx.kernels, ctx.hardware_bf16)
    if weight.dtype == torch.bfloat16 and ctx.packs_bf16():
        limit = ctx.native_rows
        fallback = TorchMethod(weight, bias, ctx.hardware_bf16) if limit is not None else None
        return PackedBF16Method(weight, bias, ctx.kernels, limit, fallback)
    if weight.dtype != torch.float32 and ctx.float32_copies and not ctx.hardware_bf16:
        return Float32CopyMethod(weight, bias, ctx.hardware_bf16)
    return TorchMethod(weight, bias, ctx.hardware_bf16)


class Linear(nn.Module):
    """y = x W^T (+ b), plus a residual when given; storage uninitialised until the checkpoint fills it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant: QuantLinear | None = None  # quantized blocks, when the checkpoint holds them
        self.method: LinearMethod | None = None

    def load(self, parts: list[torch.Tensor | QuantWeight], bias: torch.Tensor | None, name: str) -> None:
        """Take the checkpoint's tensors for this projection (several are stacked along the output, as q, k, v),
        float or quantized; a float part beside quantized ones is dequantized."""
        quantized = [isinstance(p, QuantWeight) for p in parts]
        if any(quantized) and all(quantized):
            shape = (sum(p.out_features for p in parts), parts[0].in_features)
            expected = (self.out_features, self.in_features)
            if shape != expected or any(p.in_features != shape[1] for p in parts):
                raise ValueError(f"tensor {name!r} has shape {shape}, expected {expected}")
            merged: list[QuantWeight] = []  # neighbours of one layout become one tensor
            for p in parts:
                if merged and merged[-1].layout == p.layout:
                    merged[-1] = cat_rows([merged[-1], p])
                else:
                    merged.append(p)
            self.quant = QuantLinear(merged, bias)
            self.weight = None  # the blocks are the only copy
            self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            return
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        dense = [p.dequantize().to(dtype) if isinstance(p, QuantWeight) else p for p in parts]
        joined = adjacent_rows(dense) if len(dense) > 1 else dense[0]  # consecutive rows of a stack: no copy
        put(self, "weight", torch.cat(dense) if joined is None else joined, name)
        if bias is not None:
            put(self, "bias", bias, name + ".bias")

    def process_weights_after_loading(self, ctx: LoadContext) -> None:
        """Choose this layer's method (once: a fused neighbour may have chosen it already)."""
        if self.method is not None:
            return
        if self.quant is not None:
            self.quant.native = ctx.kernels
            self.method = QuantMethod(self.quant)
            return
        self.method = choose_method(self.weight, self.bias, ctx)
        if isinstance(self.method, PackedBF16Method) and self.method.fallback is None:
            self.weight = _meta(self.weight)  # every batch reads the packed copy: it is the only one kept

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), plus `residual` when given (the native kernels add it in the same pass)."""
        return self.method.apply(x, residual)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 scores for hidden rows x (this layer as the language-model head)."""
        return self.method.logits(x)


def put(module: nn.Module, attr: str, value: torch.Tensor, name: str) -> None:
    """Set a module's parameter from a checkpoint tensor, checking its shape."""
    expected = tuple(getattr(module, attr).shape)
    if tuple(value.shape) != expected:
        raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {expected}")
    setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
