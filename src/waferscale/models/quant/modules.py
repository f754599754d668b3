"""The linear and embedding modules that serve from quantized weights, and how the kernels take activations."""

from __future__ import annotations

import os

import torch
from torch import nn

from waferscale.models.quant.layouts import QuantWeight

# without the native kernels, PyTorch dequantizes this many weights at a time (8 MiB of float32) for a GEMM. The
# native kernel serves every batch size: on the 2-core AVX2 machine, one thread, a [3072, 1024] int4 weight, it takes
# 4.3 ms at 32 rows against 39 ms for dequantize-then-GEMM, and 52 against 93 ms at 512 rows (prefill). Inside, 1-5
# rows and 6 or more take different paths (quant_kernels.c): a row's result is the same in any batch on one path,
# and differs in the last bits between them
_DEQUANT_TILE = 1 << 21
# How the kernels take activations (qgemm's act): float32 multiplies the exact weights, widened; int8 rounds every
# row to int8 per 32 (llama.cpp's Q8_0 activations: on the built-in model's Q4_1 blocks it moved next-token
# log-probabilities by 0.08 nats, four times the accuracy bar for int8 weights, scripts/quant_accuracy.py); auto
# (the default) rounds them, as llama.cpp does, where the float32 path is bound by widening the weights: per 256 for
# the two-level layouts (Q4_K, Q5_K, Q6_K, int4) below 16 rows, per 32 for 8-bit blocks (Q8_0, int8: within the
# 0.02 nats bar; Q5_0 too) below 12 rows; Q4_0, Q4_1, Q5_1 per 32 to int16 (far finer) below 6; float32 for
# larger batches.
# WAFERSCALE_QUANT_ACTIVATIONS=float32|int8|auto chooses.
ACTIVATION_MODES = {"float32": 0, "int8": 1, "auto": 2}
_act_name = os.environ.get("WAFERSCALE_QUANT_ACTIVATIONS", "auto")
if _act_name not in ACTIVATION_MODES:
    raise ValueError(f"WAFERSCALE_QUANT_ACTIVATIONS={_act_name!r}: choose one of {', '.join(ACTIVATION_MODES)}")
ACT_MODE = ACTIVATION_MODES[_act_name]
MXFP4_SCALES = 3  # QuantWeight.scale_format of MXFP4 blocks (models/quant/mxfp4.py): their own kernel


class QuantLinear(nn.Module):
    """y = x W^T (+ b) from quantized weights through the integer kernel (kernels/quant_kernels.c).

    `parts` are stacked along the output (q, k, v may come in different GGUF formats); each part writes its own
    columns of y. Where the native kernels are missing, PyTorch dequantizes a tile at a time and multiplies in
    float32 (slower; activations not rounded to int8).
    """

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.native = None  # waferscale.kernels.NativeKernels

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def project(
        self, x: torch.Tensor, out_dtype: torch.dtype = torch.float32, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T (+ b) (+ residual, bf16 only) for x [M, K] of any float dtype, as out_dtype (float32 or bf16)."""
        if x.dtype not in (torch.float32, torch.bfloat16) or self.native is None:
            x = x.float()
        x = x.contiguous()
        if self.native is None:
            return self._project_torch(x, out_dtype, residual)
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        residual = None if residual is None else residual.contiguous()
        col = 0
        for p in self.parts:
            cols = slice(col, col + p.out_features)
            bias = None if self.bias is None else self.bias[cols]
            res = None if residual is None else residual[:, cols]
            if p.scale_format == MXFP4_SCALES:  # float32 sums, rounded once to out's dtype (as decode calls read)
                self.native.mxfp4_gemm(x, p, out[:, cols], bias, act=ACT_MODE, residual=res)
            else:
                self.native.qgemm(x, p, out[:, cols], bias, res, act=ACT_MODE)
            col += p.out_features
        return out

    def _project_torch(self, x: torch.Tensor, out_dtype: torch.dtype, residual: torch.Tensor | None):
        """Without the native kernels: a tile of weights dequantized at a time, float32 GEMMs."""
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        col = 0
        for p in self.parts:
            rows = max(1, _DEQUANT_TILE // p.in_features)
            for r in range(0, p.out_features, rows):
                tile = p.dequantize(slice(r, r + rows))
                y[:, col + r : col + r + tile.shape[0]] = x @ tile.t()
            col += p.out_features
        if self.bias is not None:
            y += self.bias
        y = y.to(out_dtype)
        return y if residual is None else residual + y

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) in x's dtype, plus `residual` when given (added in the kernel's pass for bf16)."""
        if x.dtype == torch.bfloat16:
            fused = residual is not None and residual.dtype == torch.bfloat16
            y = self.project(x, torch.bfloat16, residual if fused else None)
            return y if residual is None or fused else residual + y
        y = self.project(x).to(x.dtype)
        return y if residual is None else residual + y


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized table: only the looked-up rows are dequantized."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = weight
        self.dtype = dtype
        self.native = None  # waferscale.kernels.NativeKernels: the rows dequantized in one call

    def process_weights_after_loading(self, ctx) -> None:
        """Look rows up natively where the kernels are built (the same values as dequantize's PyTorch ops)."""
        if ctx.kernels is not None and self.qweight.scale_format != MXFP4_SCALES:
            self.native = ctx.kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.qweight
        if self.native is not None:
            rows = self.native.qdequant_rows(w, ids.reshape(-1))
        else:
            rows = w.take_rows(ids.reshape(-1)).dequantize()
        return rows.to(self.dtype).view(*ids.shape, w.in_features)
