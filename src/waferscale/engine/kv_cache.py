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
    prefills: list[tuple[int, int, torch.Tensor, int, int]] = field(default_factory=list)

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
        if b:
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
        for start_row, end_row, table, start_pos, length in self.prefills:
            keys = kb.index_select(0, table).view(-1, heads, dim)[:length].transpose(0, 1).unsqueeze(0)
            values = vb.index_select(0, table).view(-1, heads, dim)[:length].transpose(0, 1).unsqueeze(0)
            mask = None
            if start_pos:
                rows = torch.arange(start_pos, start_pos + end_row - start_row).unsqueeze(1)
                mask = torch.arange(length).unsqueeze(0) <= rows
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
