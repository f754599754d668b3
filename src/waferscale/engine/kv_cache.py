"""Key/value storage in blocks shared by the whole batch, and the plan of one forward's reads and writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """One forward's attention plan, pure data (the model's attention layers read it). The first `num_decode` rows
    are single-token decodes: row i attends over the blocks `decode_tables[i]` (padded with the zero block 0) up to
    `decode_lengths[i]`. Then prefill chunks, each (row_start, row_end, block table, start position, context
    length). A layer with a sliding window narrows each row's context itself."""

    pool: KVPool
    slots: torch.Tensor  # where each row's new key/value is written
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, W * block_size]: positions below each row's length
    decode_lengths: torch.Tensor | None = None  # int64 context length of each decode row
    native: object | None = None  # waferscale.kernels.NativeKernels: decode rows read the pool in place
    prefills: list[tuple[int, int, torch.Tensor, int, int]] = field(default_factory=list)
    # masks and window starts built by the first layer that needs them and reused by the others
    cache: dict = field(default_factory=dict)

    def can_fuse_decode(self, rows: int, head_dim: int) -> bool:
        """Whether this forward is decodes only, so that a layer's rope, KV write and attention can be one call."""
        return self.native is not None and self.num_decode == rows and not self.prefills and head_dim <= 512


def prefill_batch(pool: KVPool, num_tokens: int) -> PagedBatch:
    """The plan for one sequence's whole prompt in blocks 1, 2, ... (for running the model on its own)."""
    slots = torch.arange(num_tokens) + pool.block_size
    table = torch.arange(1, 1 + -(-num_tokens // pool.block_size))
    return PagedBatch(pool, slots, prefills=[(0, num_tokens, table, 0, num_tokens)])
