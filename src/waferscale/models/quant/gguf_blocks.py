"""GGUF's quantized blocks repacked losslessly into our layouts: every value decodes to what
gguf.quants.dequantize gives."""

from __future__ import annotations

import numpy as np
import torch

from waferscale.models.quant.layouts import QuantWeight, pack_int6, weight_from_values


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
    if kind == "MXFP4":  # its own layout and kernel (models/quant/mxfp4.py)
        from waferscale.models.quant.mxfp4 import from_gguf_mxfp4

        return from_gguf_mxfp4(data, n, k)
    b = data.reshape(-1, data.shape[-1] // (k // (256 if kind.endswith("_K") else 32)))
    # Q8_0, Q4_0, Q4_1: scales (and mins) kept in float16, as stored; the kernels widen them exactly
    if kind == "Q8_0":  # d f16, 32 x int8
        q = np.ascontiguousarray(b[:, 2:]).view(np.int8).reshape(n, k)
        return weight_from_values(q, _h(b[:, :2]), None, 8, 32, signed=True)
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
        blocks = np.concatenate([qs, qh], axis=1).reshape(n, k // 32 * 20)  # our int5: the nibbles, then the bits
        qweight = torch.from_numpy(np.ascontiguousarray(blocks))
        d = torch.from_numpy(_h(b[:, :2]).reshape(n, -1))
        if kind == "Q5_0":  # d * (q - 16): signed
            return QuantWeight(qweight, d, None, 5, 32, True)
        return QuantWeight(qweight, d, torch.from_numpy(_h(b[:, 2:4]).reshape(n, -1)), 5, 32, False)  # d * q + m
    if kind in ("Q4_K", "Q5_K"):  # d, dmin f16, 12 bytes of 6-bit scales/mins, (qh,) qs
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, m = _k_scale_min(b[:, 4:16])  # scale = d * sc, min = -dmin * m: kept as two levels
        if kind == "Q4_K":
            qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            q = (qs & 15).reshape(n, k)
            return weight_from_values(q, sc, m, 4, 32, sup=d, supm=-dmin)
        qh, qs = b[:, 16:48], b[:, 48:]
        ql = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        hi = qh.reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1, 1)
        q = ((ql & 15).reshape(-1, 8, 32) | ((hi & 1).reshape(-1, 8, 32) << 4)).reshape(n, k)
        return weight_from_values(q.astype(np.uint8), sc, m, 8, 32, sup=d, supm=-dmin)
    if kind == "Q6_K":  # ql 128, qh 64, scales int8 16, d f16
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        scales = np.ascontiguousarray(sc).view(np.int8)  # scale = d * sc: kept as two levels
        lo = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        lo = (lo & 15).reshape(-1, 8, 32)
        hi = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        hi = (hi & 3).reshape(-1, 8, 32)
        q = (lo | (hi << 4)).reshape(n, k // 32, 32)  # 0..63, meaning q - 32
        return QuantWeight(torch.from_numpy(pack_int6(q)),
                           torch.from_numpy(np.ascontiguousarray(scales.reshape(n, -1))), None, 6, 16, True,
                           torch.from_numpy(np.ascontiguousarray(d.reshape(n, -1), dtype=np.float32)))
    return None
