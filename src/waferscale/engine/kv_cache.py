"""Key/value storage and attention over it: a paged pool shared by a batch, and a simple per-sequence cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class SequenceKVCache:
    """Keys and values of one sequence, [layers, 2, kv_heads, capacity, head_dim], grown by doubling."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int):
        self.shape = (num_layers, 2, num_kv_heads)
        self.head_dim, self.dtype, self.max_len = head_dim, dtype, max_len
        self.kv = torch.empty(0)
        self.length = 0  # tokens whose keys/values are stored
        self._start = self._count = 0

    def begin(self, count: int) -> None:
        """Make room for `count` new tokens written by the next forward."""
        need = self.length + count
        if need > self.kv.shape[3] if self.kv.dim() == 5 else True:
            cap = min(self.max_len, max(64, 1 << (need - 1).bit_length()))
            grown = torch.empty(*self.shape, max(cap, need), self.head_dim, dtype=self.dtype)
            if self.length:
                grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
            self.kv = grown
        self._start, self._count = self.length, count

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this forward's k/v ([T, kv_heads, head_dim]); return all keys/values and the attention mask."""
        s, t = self._start, k.shape[0]
        end = s + t
        self.kv[layer, 0, :, s:end] = k.transpose(0, 1)
        self.kv[layer, 1, :, s:end] = v.transpose(0, 1)
        keys, values = self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end]
        if t == 1:
            return keys, values, None, False
        if s == 0:
            return keys, values, None, True
        q_pos = torch.arange(s, end).unsqueeze(1)
        mask = torch.arange(end).unsqueeze(0) <= q_pos
        return keys, values, mask, False

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store k/v, then attend q ([T, heads, head_dim]) over everything stored; returns [T, heads, head_dim]."""
        keys, values, mask, causal = self.update(layer, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)

    def commit(self) -> None:
        self.length = self._start + self._count

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class KVPool:
    """Keys and values of every sequence, in blocks: [layers, blocks * block_size, kv_heads, head_dim] each.

    Slot 0 (block 0) stays zero: padded reads point there. Pages are touched only when written.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
    ):
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.k[:, :block_size].zero_()
        self.v[:, :block_size].zero_()

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
    ):
        return (
            2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        )


@dataclass
class PagedBatch:
    """One forward's attention plan: the first `num_decode` rows are single-token decodes attending over
    `decode_ctx` slots; then prefill chunks, each (row_start, row_end, context slots, start position)."""

    pool: KVPool
    slots: torch.Tensor
    num_decode: int = 0
    decode_ctx: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[tuple[int, int, torch.Tensor, int]] = field(default_factory=list)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        kc[self.slots] = k
        vc[self.slots] = v
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        b = self.num_decode
        if b:
            keys = kc[self.decode_ctx].transpose(1, 2)  # [B, kv_heads, L, head_dim]
            values = vc[self.decode_ctx].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:b].unsqueeze(2), keys, values, attn_mask=self.decode_mask, scale=scale, enable_gqa=gqa
            )
            out[:b] = o.squeeze(2)
        for start_row, end_row, ctx, start_pos in self.prefills:
            keys = kc[ctx].transpose(0, 1).unsqueeze(0)
            values = vc[ctx].transpose(0, 1).unsqueeze(0)
            mask = None
            if start_pos:
                rows = torch.arange(start_pos, start_pos + end_row - start_row).unsqueeze(1)
                mask = torch.arange(ctx.shape[0]).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(
                q[start_row:end_row].transpose(0, 1).unsqueeze(0),
                keys,
                values,
                attn_mask=mask,
                is_causal=not start_pos,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start_row:end_row] = o.squeeze(0).transpose(0, 1)
        return out
