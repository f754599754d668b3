"""Key/value storage in blocks shared by the whole batch, and attention over it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
        # zeros, not empty: the whole pool is resident from the start, so memory use is known up front and does not
        # creep up as the prefix cache fills every block
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
    ):
        return (
            2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        )


@dataclass
class PagedBatch:
    """One forward's attention plan. The first `num_decode` rows are single-token decodes: row i attends over the
    blocks `decode_tables[i]` (padded with the zero block 0), masked by `decode_mask`. Then prefill chunks, each
    (row_start, row_end, block table, start position, context length)."""

    pool: KVPool
    slots: torch.Tensor  # where each row's new key/value is written
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None  # int64 context length of each decode row
    native: object | None = None  # waferscale.kernels.NativeKernels: decode rows read the pool in place
    prefills: list[tuple[int, int, torch.Tensor, int, int]] = field(default_factory=list)
    # each prefill chunk's additive causal mask over its context (0 or -inf, the pool's dtype): built by the first
    # layer, reused by the others
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def can_fuse_decode(self, rows: int, head_dim: int) -> bool:
        """Whether this forward is decodes only, so that a layer's rope, KV write and attention can be one call."""
        return self.native is not None and self.num_decode == rows and not self.prefills and head_dim <= 512

    def _decode_args(self, layer: int, rope: tuple[torch.Tensor, torch.Tensor], rows: int) -> tuple:
        """What the native decode calls take after their own input: rope rows, the layer's caches, the plan."""
        cos, sin = rope
        pool = self.pool
        return (cos.reshape(rows, -1), sin.reshape(rows, -1), pool.k[layer], pool.v[layer], self.slots)

    def attend_decode_fused(
        self,
        layer: int,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """Decode rows only (see can_fuse_decode): qkv bf16 [B, (H + 2 KVH) D] in, attention output bf16 [B, H D]."""
        return self.native.decode_attention_bf16(
            qkv.contiguous(),
            *self._decode_args(layer, rope, qkv.shape[0]),
            self.decode_tables,
            self.decode_lengths,
            num_heads,
            scale,
            self.pool.block_size,
        )

    def decode_layer(
        self,
        layer: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        weights,
        num_heads: int,
        scale: float,
    ) -> None:
        """A whole decoder layer for decode rows only (see can_fuse_decode), in place on h: bf16 [B, E]; weights:
        waferscale.kernels.DecodeLayerWeights."""
        self.native.decode_layer_bf16(
            h,
            weights,
            *self._decode_args(layer, rope, h.shape[0]),
            self.decode_tables,
            self.decode_lengths,
            num_heads,
            scale,
            self.pool.block_size,
        )

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        pool = self.pool
        kc, vc = pool.k[layer], pool.v[layer]
        kc.index_copy_(0, self.slots, k.to(kc.dtype))
        vc.index_copy_(0, self.slots, v.to(vc.dtype))
        # whole blocks are gathered with index_select (contiguous rows): an order of magnitude faster than
        # advanced indexing, which copies element by element
        kb = kc.view(-1, pool.block_size * kc.shape[1] * kc.shape[2])
        vb = vc.view(-1, pool.block_size * vc.shape[1] * vc.shape[2])
        heads, dim = kc.shape[1], kc.shape[2]
        gqa = q.shape[1] != k.shape[1]
        out_dtype = q.dtype
        q = q.to(kc.dtype)  # attention runs in the pool's dtype
        out = torch.empty_like(q)
        b = self.num_decode
        if b and self.native is not None:
            o = self.native.paged_decode_attention(
                q[:b].float().contiguous(),
                kc,
                vc,
                self.decode_tables,
                self.decode_lengths,
                scale,
                pool.block_size,
            )
            out[:b] = o.to(out.dtype)
        elif b:
            tables = self.decode_tables
            shape = (b, -1, heads, dim)
            keys = (
                kb.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
            )  # [B, kv_heads, L, head_dim]
            values = vb.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:b].unsqueeze(2), keys, values, attn_mask=self.decode_mask, scale=scale, enable_gqa=gqa
            )
            out[:b] = o.squeeze(2)
        for n, (start_row, end_row, table, start_pos, length) in enumerate(self.prefills):
            keys = kb.index_select(0, table).view(-1, heads, dim)[:length].transpose(0, 1).unsqueeze(0)
            values = vb.index_select(0, table).view(-1, heads, dim)[:length].transpose(0, 1).unsqueeze(0)
            mask = None
            if start_pos:
                mask = self.prefill_masks.get(n)
                if mask is None:
                    rows = torch.arange(start_pos, start_pos + end_row - start_row).unsqueeze(1)
                    allowed = torch.arange(length).unsqueeze(0) <= rows
                    mask = torch.zeros(allowed.shape, dtype=kc.dtype).masked_fill_(~allowed, float("-inf"))
                    self.prefill_masks[n] = mask
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
        return out.to(out_dtype)


def prefill_batch(pool: KVPool, num_tokens: int) -> PagedBatch:
    """The plan for one sequence's whole prompt in blocks 1, 2, ... (for running the model on its own)."""
    slots = torch.arange(num_tokens) + pool.block_size
    table = torch.arange(1, 1 + -(-num_tokens // pool.block_size))
    return PagedBatch(pool, slots, prefills=[(0, num_tokens, table, 0, num_tokens)])
