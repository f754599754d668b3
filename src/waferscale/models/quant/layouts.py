"""Our four block layouts (QuantWeight; see the package docstring) and --quantization int8/int4's quantizers."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

QUANTIZATIONS = ("auto", "none", "int8", "int4")
GROUP = 32  # --quantization int8/int4 group size along K


@dataclass
class QuantWeight:
    """A [N, K] weight in one of our four block layouts (see the package docstring)."""

    qweight: torch.Tensor  # int8/uint8 [N, K] (bits 8), uint8 [N, K / 32 * 24] (6), [N, K / 32 * 20] (5), [N, K / 2] (4)
    scales: torch.Tensor  # float32 [N, K / group]; with sup: int8 (signed) or uint8 [N, K / group]
    mins: torch.Tensor | None  # float32 [N, K / group], or None; with supm: uint8 [N, K / group]
    bits: int
    group: int
    signed: bool = True  # bits 8: q is int8 (else 0..127); bits 5: q - 16 (else q); bits 6: q - 32
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
        # per 32-weight block: 16 bytes of nibbles (weight j low, j + 16 high), then for bits 5 a uint32 whose bit j
        # is weight j's fifth, for bits 6 8 bytes, byte i holding weight i + 8 t's top two bits at bit 2 t
        blocks = self.qweight.view(torch.uint8).view(self.out_features, -1, {4: 16, 5: 20, 6: 24}[self.bits])
        blocks = blocks.to(torch.int32)
        nib, hi = blocks[..., :16], blocks[..., 16:]
        q = torch.cat([nib & 15, nib >> 4], dim=-1)
        if self.bits == 5:
            q = q | ((((hi.unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)) << 4)  # [N, blocks, 4 bytes x 8]
        if self.bits == 6:
            q = q | ((((hi.unsqueeze(-2) >> (2 * torch.arange(4)).unsqueeze(-1)) & 3).flatten(-2)) << 4)  # [.., 4 t, 8 i]
        if self.signed and self.bits != 4:
            q = q - (16 if self.bits == 5 else 32)
        return q.view(self.out_features, -1)

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
        bits, group, signed, *kind = tensors.pop(f"{name}.qlayout").tolist()
        if kind and kind[0]:  # MXFP4 (models/quant/mxfp4.py)
            from waferscale.models.quant.mxfp4 import MXFP4_KIND, Mxfp4Weight

            interleaved = kind[0] == MXFP4_KIND[True]
            q, scales = tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scales")
            return Mxfp4Weight(q, scales, None, bits, group, bool(signed), interleaved=interleaved)
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


def adjacent_rows(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The rows of `parts` as one tensor without a copy, where each part is contiguous and starts where the one
    before it ends in the same storage (views of one stack's consecutive rows, as an expert's gate and up are in
    a stacked checkpoint); None otherwise."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    at = first.storage_offset()
    for p in parts:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.shape[1:] != first.shape[1:]
            or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or p.storage_offset() != at
        ):
            return None
        at += p.numel()
    rows = sum(p.shape[0] for p in parts)
    stride = (math.prod(first.shape[1:]), *first.stride()[1:])
    return first.as_strided((rows, *first.shape[1:]), stride, first.storage_offset())


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stack weights of one layout along N (q, k, v into qkv): a view where they are consecutive rows of one
    stack already (adjacent_rows), else a copy."""
    keys = [k for k in ("qweight", "scales", "mins", "sup", "supm") if getattr(parts[0], k) is not None]
    joined = {k: adjacent_rows([getattr(p, k) for p in parts]) for k in keys}
    if all(v is not None for v in joined.values()):
        fields = {f.name: getattr(parts[0], f.name) for f in dataclasses.fields(parts[0])}
        return type(parts[0])(**{**fields, **joined})
    if hasattr(parts[0], "cat"):  # a layout with its own stacking (MXFP4)
        return parts[0].cat(parts)

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


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [N, K] -> [N, K / 2]: per 32-block, byte j = q[j] | q[j + 16] << 4."""
    n = q.shape[0]
    blocks = q.reshape(n, -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, -1).astype(np.uint8)


def pack_high_pairs(q: np.ndarray) -> np.ndarray:
    """The top two bits of 6-bit values q [N, blocks, 32] as int6 stores them: [N, blocks, 8], byte i holding weights
    i, i + 8, i + 16 and i + 24 in its bit pairs 0, 2, 4 and 6."""
    top = (q.astype(np.uint8) >> 4) & 3
    quarters = top.reshape(*q.shape[:-1], 4, 8)
    return (quarters[..., 0, :] | quarters[..., 1, :] << 2 | quarters[..., 2, :] << 4 | quarters[..., 3, :] << 6).astype(
        np.uint8
    )


def pack_int6(q: np.ndarray) -> np.ndarray:
    """6-bit values q [N, blocks, 32] (0..63) as int6 holds them: [N, blocks * 24] bytes, each block its nibbles as
    int4 holds them, then its top bits (pack_high_pairs)."""
    n = q.shape[0]
    nibbles = pack_nibbles((q & 15).reshape(n, -1)).reshape(n, -1, 16)
    return np.ascontiguousarray(np.concatenate([nibbles, pack_high_pairs(q)], axis=2).reshape(n, -1))


def weight_from_values(
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
        qweight = torch.from_numpy(pack_nibbles(q.astype(np.uint8)))
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


_QUANTIZE_ROWS_WEIGHTS = 1 << 22  # quantize() works on rows of about so many weights at a time


def quantize(weight: torch.Tensor, method: str, group: int = GROUP) -> QuantWeight:
    """--quantization int8 (symmetric: scale = max|w| / 127) or int4 (scale and min from each group's range; where
    K is a multiple of 256, in Q4_K's two-level form, see _int4_two_level). Rows are quantized independently, a
    few MiB of them at a time: whole, a large weight (an embedding table) took several float32 copies of itself."""
    n, k = weight.shape
    if k % group or k % 32:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group} (and of 32)")
    rows = max(1, _QUANTIZE_ROWS_WEIGHTS // k)
    if n > rows:
        return cat_rows([_quantize_rows(weight[r : r + rows], method, group) for r in range(0, n, rows)])
    return _quantize_rows(weight, method, group)


def _quantize_rows(weight: torch.Tensor, method: str, group: int) -> QuantWeight:
    n, k = weight.shape
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
        packed = pack_nibbles(q.to(torch.uint8).view(n, k).numpy())
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
    packed = pack_nibbles(q.to(torch.uint8).view(n, -1).numpy())
    return QuantWeight(torch.from_numpy(packed), sc, m, 4, 32, False, sup, supm)
