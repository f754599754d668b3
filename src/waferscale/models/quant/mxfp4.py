"""MXFP4 weights (gpt-oss's experts): blocks of 32 weights, each an e2m1 float in a nibble (0, 0.5, 1, 1.5, 2, 3,
4, 6 and their negatives), and one e8m0 scale a block (a byte e: 2^(e - 127)). Kept in their blocks and multiplied
by the native kernel (kernels/mxfp4_kernels.c); never dequantized to a second copy except for the float32 exact
path.

Two nibble orders, both served as stored: the released checkpoints' (`*_blocks` [..., N, K / 32, 16]: byte j of a
block holds weights 2j (low nibble) and 2j + 1 (high), transformers' integrations/mxfp4.py) and GGUF's MXFP4 type
(byte j holds weights j and j + 16, ggml's dequantize_row_mxfp4). Values are stored doubled (-12..12, ggml's
kvalues_mxfp4) against half the scale, 2^(e - 128): the same products, exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from waferscale.models.quant.layouts import QuantWeight

# the e2m1 values doubled, by nibble (sign in the high bit), as ggml's kvalues_mxfp4
KVALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int32)
_MIDPOINTS = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0])  # between neighbouring doubled magnitudes
BLOCK = 32
MXFP4_KIND = {False: 1, True: 2}  # qlayout's 4th entry: GGUF's nibble order, the checkpoints' interleaved one


def half_scales(e: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 128) for e8m0 bytes, built from their bits (exact, subnormals included)."""
    e = e.to(torch.int32)
    bits = torch.where(e >= 2, (e - 1) << 23, torch.ones_like(e) << (21 + e.clamp(max=1)))
    return bits.view(torch.float32)


@dataclass
class Mxfp4Weight(QuantWeight):
    """A [N, K] MXFP4 weight: qweight uint8 [N, K / 2] (16 bytes a block), scales uint8 e8m0 [N, K / 32];
    `interleaved`: the checkpoints' nibble order (else GGUF's)."""

    interleaved: bool = False

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, scales: torch.Tensor, interleaved: bool) -> Mxfp4Weight:
        """From blocks uint8 [..., N, K / 32, 16] and scales [..., N, K / 32]: leading dimensions (experts)
        stacked along N."""
        if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(
                f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                "expected [..., G, 16] and [..., G]"
            )
        groups = scales.shape[-1]
        q = blocks.reshape(-1, groups * 16).view(torch.uint8)
        return cls(q.contiguous(), scales.reshape(-1, groups).view(torch.uint8).contiguous(), None, 4, BLOCK,
                   True, interleaved=interleaved)

    @property
    def layout(self):
        return ("mxfp4", self.interleaved)

    @property
    def scale_format(self) -> int:
        return 3  # e8m0 bytes

    def scale_values(self) -> torch.Tensor:
        return half_scales(self.scales)

    def values(self) -> torch.Tensor:
        """The doubled e2m1 values as int32 [N, K], in weight order."""
        q = self.qweight.view(torch.uint8).view(self.out_features, -1, 16).to(torch.int64)
        lo, hi = KVALUES[q & 15], KVALUES[q >> 4]
        both = torch.stack([lo, hi], dim=-1) if self.interleaved else torch.cat([lo, hi], dim=-1)
        return both.reshape(self.out_features, -1)

    def take_rows(self, index: torch.Tensor | slice) -> Mxfp4Weight:
        return Mxfp4Weight(self.qweight[index].contiguous(), self.scales[index].contiguous(), None, 4, BLOCK, True,
                           interleaved=self.interleaved)

    def to_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return {
            f"{name}.qweight": self.qweight.contiguous(),
            f"{name}.scales": self.scales.contiguous(),
            f"{name}.qlayout": torch.tensor([4, BLOCK, 1, MXFP4_KIND[self.interleaved]], dtype=torch.int32),
        }

    @staticmethod
    def cat(parts: list[Mxfp4Weight]) -> Mxfp4Weight:
        """Stacked along N (gate and up into one projection)."""
        return Mxfp4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), None, 4,
                           BLOCK, True, interleaved=parts[0].interleaved)


def quantize_mxfp4(weight: torch.Tensor, interleaved: bool = False) -> Mxfp4Weight:
    """A float [N, K] weight rounded to MXFP4 (the reference for tests and tiny models): each block's scale the
    smallest power of two that fits its largest magnitude within 6, each weight the nearest e2m1 value."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    w = weight.detach().float().reshape(n, -1, BLOCK)
    amax = w.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # 2^exp: the block's scale
    e = (exp + 127).to(torch.int32)
    scaled = w * 2.0 * torch.exp2(-exp).unsqueeze(-1)  # in doubled units, within -12..12
    # the nearest magnitude of 0, 1, 2, 3, 4, 6, 8, 12 (a tie to the smaller), its sign in bit 3 (none for 0)
    magnitude = torch.bucketize(scaled.abs().contiguous(), _MIDPOINTS)
    nibble = (magnitude + 8 * ((scaled < 0) & (magnitude > 0))).to(torch.uint8)
    if interleaved:  # byte j: weights 2j, 2j + 1
        pairs = nibble.view(n, -1, 16, 2)
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    else:  # byte j: weights j, j + 16
        halves = nibble.view(n, -1, 2, 16)
        q = halves[:, :, 0] | (halves[:, :, 1] << 4)
    return Mxfp4Weight(q.reshape(n, -1).contiguous(), e.to(torch.uint8).contiguous(), None, 4, BLOCK, True,
                       interleaved=interleaved)


def from_gguf_mxfp4(data, n: int, k: int) -> Mxfp4Weight:
    """GGUF's MXFP4 blocks (17 bytes: e8m0 scale, 16 bytes of nibbles) of a [n, k] tensor, kept as they are
    (split into the nibbles and the scales)."""
    b = torch.from_numpy(data.reshape(-1, 17).copy())
    return Mxfp4Weight(b[:, 1:].reshape(n, k // 2).contiguous(), b[:, 0].reshape(n, k // BLOCK).contiguous(), None,
                       4, BLOCK, True, interleaved=False)
