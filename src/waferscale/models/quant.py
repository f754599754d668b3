"""Weight-only quantized weights: our two block layouts, GGUF's formats repacked into them losslessly, and the
linear and embedding modules that serve from them (kernels/quant_kernels.c), with no float copy kept.

A weight [N, K] is scale * q + min per group of `group` weights along K:
  int8: q one signed byte (Q8_0, Q6_K, Q5_0's values less 16, --quantization int8) or one unsigned byte 0..127
        (Q5_K's and Q5_1's 5-bit values);
  int4: q one nibble 0..15, two a byte (Q4_0, Q4_1, Q4_K, --quantization int4).
Scales and mins are [N, K / group] in one of three formats (QuantWeight.scale_format); mins may be absent
(symmetric): float32 (--quantization int8, and int4 where K is not a multiple of 256); float16 as Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 store them; or two levels as GGUF's K-quants store them (and int4 where K allows): bytes [N, K / group] times a
float32 per 256 weights (sup, supm [N, K / 256]). The kernels widen or multiply them out where they use them (the
same float32 value: an f16 times a 6- or 8-bit integer is exact), so a Q4_K weight costs 0.59 bytes instead of
0.75. Every GGUF value decodes to exactly what gguf.quants.dequantize gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

QUANTIZATIONS = ("auto", "none", "int8", "int4")
GROUP = 32  # --quantization int8/int4 group size along K
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
# 0.02 nats bar; Q5_0 too) below 12 rows; float32 for Q4_0, Q4_1, Q5_1 and larger batches. WAFERSCALE_QUANT_ACTIVATIONS=float32|int8|auto chooses.
ACTIVATION_MODES = {"float32": 0, "int8": 1, "auto": 2}
_act_name = os.environ.get("WAFERSCALE_QUANT_ACTIVATIONS", "auto")
if _act_name not in ACTIVATION_MODES:
    raise ValueError(f"WAFERSCALE_QUANT_ACTIVATIONS={_act_name!r}: choose one of {', '.join(ACTIVATION_MODES)}")
ACT_MODE = ACTIVATION_MODES[_act_name]


@dataclass
class QuantWeight:
    """A [N, K] weight in one of our two block layouts (see the module docstring)."""

    qweight: torch.Tensor  # int8/uint8 [N, K] (bits 8) or uint8 [N, K / 2] (bits 4)
    scales: torch.Tensor  # float32 [N, K / group]; with sup: int8 (signed) or uint8 [N, K / group]
    mins: torch.Tensor | None  # float32 [N, K / group], or None; with supm: uint8 [N, K / group]
    bits: int
    group: int
    signed: bool = True  # bits 8 only: q is int8 (else 0..127)
    sup: torch.Tensor | None = None  # two-level scales (K-quants): float32 [N, K / 256], scale = sup * scales
    supm: torch.Tensor | None = None  # and mins: min = supm * mins

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def layout(self) -> tuple[int, int, bool, bool, int]:
        """What two weights must share to be stored as one tensor."""
        return (self.bits, self.group, self.signed, self.mins is not None, self.scale_format)

    @property
    def scale_format(self) -> int:
        """How scales and mins are stored, for the kernels: 0 float32, 1 float16, 2 two-level (bytes times sup)."""
        return 2 if self.sup is not None else 1 if self.scales.dtype == torch.float16 else 0

    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins, self.sup, self.supm)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def scale_values(self) -> torch.Tensor:
        """The scales as float32 [N, K / group] (two-level ones multiplied out, as the kernels do)."""
        return _two_level(self.scales, self.sup)

    def min_values(self) -> torch.Tensor | None:
        """The mins as float32 [N, K / group], or None."""
        return None if self.mins is None else _two_level(self.mins, self.supm)

    def values(self) -> torch.Tensor:
        """q as int32 [N, K]."""
        if self.bits == 8:
            return self.qweight.view(torch.int8 if self.signed else torch.uint8).to(torch.int32)
        q = self.qweight.view(torch.uint8).view(self.out_features, -1, 16).to(torch.int32)
        return torch.cat([q & 15, q >> 4], dim=-1).view(self.out_features, -1)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 [n, K] of the chosen rows, scale * q + min (in PyTorch: the reference the kernels are tested on)."""
        part = self.take_rows(rows)
        q = part.values().float().view(part.out_features, -1, self.group)
        w = q * part.scale_values().unsqueeze(-1)
        if part.mins is not None:
            w = w + part.min_values().unsqueeze(-1)
        return w.view(part.out_features, -1)

    def take_rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """The rows at index (a row permutation, or a slice of rows)."""

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index].contiguous()

        return QuantWeight(
            rows(self.qweight),
            rows(self.scales),
            rows(self.mins),
            self.bits,
            self.group,
            self.signed,
            rows(self.sup),
            rows(self.supm),
        )

    def to_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Tensors for a safetensors file: name.qweight, name.scales, name.mins, name.sup, name.supm, name.qlayout."""
        out = {
            f"{name}.qweight": self.qweight.contiguous(),
            f"{name}.scales": self.scales.contiguous(),
            f"{name}.qlayout": torch.tensor([self.bits, self.group, int(self.signed)], dtype=torch.int32),
        }
        for key in ("mins", "sup", "supm"):
            if (t := getattr(self, key)) is not None:
                out[f"{name}.{key}"] = t.contiguous()
        return out

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], name: str) -> QuantWeight:
        """The weight that to_tensors stored under name (its tensors popped from the dict)."""
        bits, group, signed = tensors.pop(f"{name}.qlayout").tolist()
        return QuantWeight(
            tensors.pop(f"{name}.qweight"),
            tensors.pop(f"{name}.scales"),
            tensors.pop(f"{name}.mins", None),
            bits,
            group,
            bool(signed),
            tensors.pop(f"{name}.sup", None),
            tensors.pop(f"{name}.supm", None),
        )


def gather_quantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | QuantWeight]:
    """Turn every stored QuantWeight's tensors (name.qweight, ...) into one QuantWeight entry under name."""
    names = [k[: -len(".qlayout")] for k in tensors if k.endswith(".qlayout")]
    out: dict = dict(tensors)
    for name in names:
        out[name] = QuantWeight.from_tensors(out, name)
    return out


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one layout along N (q, k, v into qkv)."""
    def cat(key: str) -> torch.Tensor | None:
        return None if getattr(parts[0], key) is None else torch.cat([getattr(p, key) for p in parts])

    first = parts[0]
    return QuantWeight(
        cat("qweight"), cat("scales"), cat("mins"), first.bits, first.group, first.signed, cat("sup"), cat("supm")
    )


def _two_level(sub: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:
    """float32 [N, K / group] from one-level float32 or float16 values, or bytes times a float32 per 256 weights."""
    if sup is None:
        return sub.float()
    per = sub.shape[1] // sup.shape[1]
    return sup.repeat_interleave(per, dim=1) * sub.to(torch.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [N, K] -> [N, K / 2]: per 32-block, byte j = q[j] | q[j + 16] << 4."""
    n = q.shape[0]
    blocks = q.reshape(n, -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, -1).astype(np.uint8)


def _weight(
    q: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
    bits: int,
    group: int,
    signed: bool = False,
    sup: np.ndarray | None = None,
    supm: np.ndarray | None = None,
) -> QuantWeight:
    """A QuantWeight from integer values q [N, K] and float32 scales/mins [N, K / group]; or, two-level, their bytes
    (signed as q) and float32 sup/supm per 256 weights."""
    n = q.shape[0]
    if bits == 4:
        qweight = torch.from_numpy(_pack_nibbles(q.astype(np.uint8)))
    else:
        qweight = torch.from_numpy(q.astype(np.int8 if signed else np.uint8))

    def rows(a: np.ndarray | None, dtype) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a.reshape(n, -1), dtype=dtype))

    two = sup is not None
    one = np.float16 if scales.dtype == np.float16 else np.float32  # one-level: float32, or float16 as stored
    return QuantWeight(
        qweight,
        rows(scales, (np.int8 if signed else np.uint8) if two else one),
        rows(mins, np.uint8 if two else one),
        bits,
        group,
        signed,
        rows(sup, np.float32),
        rows(supm, np.float32),
    )


def quantize(weight: torch.Tensor, method: str, group: int = GROUP) -> QuantWeight:
    """--quantization int8 (symmetric: scale = max|w| / 127) or int4 (scale and min from each group's range; where
    K is a multiple of 256, in Q4_K's two-level form, see _int4_two_level)."""
    n, k = weight.shape
    if k % group or k % 32:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group} (and of 32)")
    w = weight.detach().float().view(n, -1, group)
    if method == "int8":
        scale = w.abs().amax(-1) / 127
        q = torch.round(w / torch.where(scale == 0, 1, scale).unsqueeze(-1)).clamp(-127, 127)
        return QuantWeight(q.to(torch.int8).view(n, k), scale.contiguous(), None, 8, group, True)
    if method == "int4" and group == 32 and k % 256 == 0:
        return _int4_two_level(w)
    if method == "int4":
        lo, hi = w.amin(-1), w.amax(-1)
        scale = (hi - lo) / 15
        q = torch.round((w - lo.unsqueeze(-1)) / torch.where(scale == 0, 1, scale).unsqueeze(-1)).clamp(0, 15)
        packed = _pack_nibbles(q.to(torch.uint8).view(n, k).numpy())
        return QuantWeight(torch.from_numpy(packed), scale.contiguous(), lo.contiguous(), 4, group, False)
    raise ValueError(f"unknown quantization {method!r} (choose one of: {', '.join(QUANTIZATIONS)})")


def _int4_two_level(w: torch.Tensor) -> QuantWeight:
    """int4 as Q4_K stores it: per 32 weights a 6-bit scale and min (bytes), per 256 a float32 d and dmin; weight =
    d * sc * q - dmin * m. Each group's range is widened to include 0 (so that min <= 0), its scale and min rounded
    to 6 bits of the super-block's largest, and q taken against the rounded ones. 0.59 bytes a weight instead of
    0.75, and served by the K-quants' integer kernel below 16 rows."""
    n = w.shape[0]
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)  # [n, K / 32]
    scale, depth = ((hi - lo) / 15).view(n, -1, 8), (-lo).view(n, -1, 8)
    d, dmin = scale.amax(-1) / 63, depth.amax(-1) / 63  # [n, K / 256]

    def six_bits(v: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        return torch.round(v / torch.where(unit == 0, 1, unit).unsqueeze(-1)).clamp(0, 63).to(torch.uint8)

    sc, m = six_bits(scale, d).view(n, -1), six_bits(depth, dmin).view(n, -1)
    sup, supm = d.contiguous(), (-dmin).contiguous()
    s_eff, min_eff = _two_level(sc, sup), _two_level(m, supm)  # float32, as the kernels form them
    q = torch.round((w - min_eff.unsqueeze(-1)) / torch.where(s_eff == 0, 1, s_eff).unsqueeze(-1)).clamp(0, 15)
    packed = _pack_nibbles(q.to(torch.uint8).view(n, -1).numpy())
    return QuantWeight(torch.from_numpy(packed), sc, m, 4, 32, False, sup, supm)


# ---------------------------------------------------------------- GGUF blocks -> our layouts


def _f16(b: np.ndarray) -> np.ndarray:
    return _h(b).astype(np.float32)


def _h(b: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes a row) as they are."""
    return np.ascontiguousarray(b).view(np.float16)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit sub-block scales and mins [blocks, 8], as bytes (gguf.quants.Q4_K.get_scale_min)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(scales))
    return sc.reshape(-1, 8).astype(np.uint8), m.reshape(-1, 8).astype(np.uint8)


def from_gguf(data: np.ndarray, kind: str, n: int, k: int) -> QuantWeight | None:
    """A GGUF tensor's raw blocks (uint8 [n, bytes a row]) as a QuantWeight, or None for other formats."""
    b = data.reshape(-1, data.shape[-1] // (k // (256 if kind.endswith("_K") else 32)))
    # Q8_0, Q4_0, Q4_1: scales (and mins) kept in float16, as stored; the kernels widen them exactly
    if kind == "Q8_0":  # d f16, 32 x int8
        q = np.ascontiguousarray(b[:, 2:]).view(np.int8).reshape(n, k)
        return _weight(q, _h(b[:, :2]), None, 8, 32, signed=True)
    if kind in ("Q4_0", "Q4_1"):  # d (, m) f16, 16 bytes of nibbles: byte j = q[j] | q[j + 16] << 4
        d = _h(b[:, :2])
        with np.errstate(over="ignore"):
            mins = -8 * d if kind == "Q4_0" else _h(b[:, 2:4])  # -8 d: exact in float16 unless it overflows
        if not np.isfinite(mins).all() and np.isfinite(d).all():
            d, mins = d.astype(np.float32), -8 * d.astype(np.float32)
        qs = b[:, 2:] if kind == "Q4_0" else b[:, 4:]
        qweight = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2))
        return QuantWeight(
            qweight, torch.from_numpy(d.reshape(n, -1)), torch.from_numpy(mins.reshape(n, -1)), 4, 32, False
        )
    if kind in ("Q5_0", "Q5_1"):  # d (, m) f16, qh: bit j of a uint32 is q[j]'s fifth, 16 bytes of nibbles as Q4_*
        qh, qs = (b[:, 2:6], b[:, 6:]) if kind == "Q5_0" else (b[:, 4:8], b[:, 8:])
        hi = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [blocks, 32]
        lo = qs.reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)  # q[j], q[j + 16]
        q = ((lo & 15).reshape(-1, 32) | ((hi & 1).astype(np.uint8) << 4)).reshape(n, k)
        if kind == "Q5_0":  # d * (q - 16): a signed byte -16..15 and its float16 scale, Q8_0's layout
            return _weight(q.astype(np.int8) - np.int8(16), _h(b[:, :2]), None, 8, 32, signed=True)
        return _weight(q, _h(b[:, :2]), _h(b[:, 2:4]), 8, 32)  # d * q + m: a byte 0..31, float16 scale and min
    if kind in ("Q4_K", "Q5_K"):  # d, dmin f16, 12 bytes of 6-bit scales/mins, (qh,) qs
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, m = _k_scale_min(b[:, 4:16])  # scale = d * sc, min = -dmin * m: kept as two levels
        if kind == "Q4_K":
            qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            q = (qs & 15).reshape(n, k)
            return _weight(q, sc, m, 4, 32, sup=d, supm=-dmin)
        qh, qs = b[:, 16:48], b[:, 48:]
        ql = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        hi = qh.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1, 1)
        q = ((ql & 15).reshape(-1, 8, 32) | ((hi & 1).reshape(-1, 8, 32) << 4)).reshape(n, k)
        return _weight(q.astype(np.uint8), sc, m, 8, 32, sup=d, supm=-dmin)
    if kind == "Q6_K":  # ql 128, qh 64, scales int8 16, d f16
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        scales = np.ascontiguousarray(sc).view(np.int8)  # scale = d * sc: kept as two levels
        lo = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        lo = (lo & 15).reshape(-1, 8, 32)
        hi = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        hi = (hi & 3).reshape(-1, 8, 32)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        return _weight(q.reshape(n, k), scales, None, 8, 16, signed=True, sup=d)
    return None


# ---------------------------------------------------------------- modules


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
        self.bias = None if bias is None else bias.detach().float()
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.qweight
        rows = w.take_rows(ids.reshape(-1))
        return rows.dequantize().to(self.dtype).view(*ids.shape, w.in_features)
