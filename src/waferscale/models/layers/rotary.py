"""Rotary position embeddings: inverse frequencies for each rope kind (default, linear, llama3, YaRN, GGUF
frequency factors) and cos/sin tables computed as transformers computes them."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

ROPE_KINDS = ("default", "linear", "llama3", "yarn", "freq_factors")


def _yarn(dim: int, base: float, scaling: dict[str, Any], max_positions: int):
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (transformers'
    _compute_yarn_parameters), and its attention scaling factor."""
    old_len = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / old_len
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is not None:
        attention = scaling["attention_factor"]
    elif mscale and mscale_all:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    else:
        attention = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation, attention


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int = 0
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for one rope kind."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
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
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_positions)
    if kind == "freq_factors":  # GGUF rope_freqs tensor: per-dimension divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")


_CHUNK = 256  # positions whose cos/sin rows a single stream's decode steps compute at once and then read
# chunks kept (each 2 x 256 x head_dim values: 256 KB for head_dim 256 in bf16): one at a time is read while a stream
# decodes, the one before it while streams at other positions take turns
_CHUNKS_KEPT = 2


class Rotary(nn.Module):
    """cos/sin rows computed for the positions of each step, as transformers computes them (float32 products of
    position and inverse frequency, then cos/sin, scaled): no table over the whole context, which at 32k-128k
    positions would hold 16-134 MB a model for rows a step mostly never reads; a single position's row is read from
    the chunk of 256 positions that holds it, computed once (the same values: the ops are elementwise)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
        dtype: torch.dtype,
        model_max_positions: int = 0,
    ):
        super().__init__()
        inv_freq, scale = rope_inv_freq(head_dim, theta, scaling, model_max_positions or max_positions)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scale = scale
        self.dtype = dtype
        self._chunks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # the latest, oldest first

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for these positions, shaped [T, 1, head_dim] to broadcast over heads."""
        if positions.numel() == 1:  # a single stream's decode step: a row of the chunk that holds its position
            c, i = divmod(int(positions), _CHUNK)
            chunk = self._chunks.get(c)
            if chunk is None:
                chunk = self._chunks[c] = self._compute(torch.arange(c * _CHUNK, (c + 1) * _CHUNK))
                if len(self._chunks) > _CHUNKS_KEPT:
                    self._chunks.popitem(last=False)
            return chunk[0][i : i + 1], chunk[1][i : i + 1]
        return self._compute(positions)

    def _apply(self, fn, *args, **kwargs):
        """A cast or move of the module (`.to()`, `.half()`) computes the chunks again from its new buffers."""
        self._chunks.clear()
        return super()._apply(fn, *args, **kwargs)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, elementwise (a position's values do not depend on the others')."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (the Hugging Face weight layout) on x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
