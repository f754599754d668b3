"""Key/value storage in pages shared by the whole batch, how layers are grouped onto them, and the plan of one
forward's reads and writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

import torch

from waferscale.engine.block_manager import BlockKind


@dataclass(frozen=True)
class KVLayout:
    """Which layers share a block table. Layers of one kind (whole context, or one sliding window) are cut into
    groups of `group_size` layers, the same size for every kind (the greatest common divisor of the kinds' layer
    counts); a page is `block_size` tokens of one group, and a kind's block is one page per group of that kind, so
    both kinds draw on one pool. A window kind's blocks that no window can see any more are given back (see
    Scheduler), which is what bounds a window layer's memory by its window."""

    windows: tuple[int | None, ...]  # each layer's sliding window (None: the whole context)

    @property
    def kinds(self) -> tuple[int | None, ...]:
        """The window of each kind, full context (None) first."""
        return tuple(sorted(set(self.windows), key=lambda w: -1 if w is None else w))

    @property
    def group_size(self) -> int:
        g = 0
        for w in self.kinds:
            g = gcd(g, self.windows.count(w))
        return g

    def kind_layers(self, kind: int) -> list[int]:
        return [i for i, w in enumerate(self.windows) if w == self.kinds[kind]]

    @property
    def block_kinds(self) -> tuple[BlockKind, ...]:
        g = self.group_size
        return tuple(BlockKind(w, len(self.kind_layers(k)) // g) for k, w in enumerate(self.kinds))

    @property
    def groups(self) -> list[tuple[int, int]]:
        """(kind, index of the group within its kind's block) of each group, in order."""
        return [(k, r) for k, bk in enumerate(self.block_kinds) for r in range(bk.pages)]

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, slice of the pool) of a layer."""
        k = self.kinds.index(self.windows[layer])
        i = self.kind_layers(k).index(layer)
        g = self.group_size
        group = sum(bk.pages for bk in self.block_kinds[:k]) + i // g
        return group, i % g


class KVPool:
    """Keys and values of every sequence, in pages: [group_size, pages * block_size, kv_heads, head_dim] each; a
    layer reads the slice of its place in its group (KVLayout). Without windows, one group holds every layer and a
    page is a block of every layer, as a plain paged cache.

    Page 0 stays zero: padded reads point there. Pages are touched only when written.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        windows: tuple[int | None, ...] | None = None,
    ):
        self.block_size = block_size
        self.layout = KVLayout(tuple(windows) if windows is not None else (None,) * num_layers)
        if len(self.layout.windows) != num_layers:
            raise ValueError(f"{len(self.layout.windows)} windows given for {num_layers} layers")
        self.place = [self.layout.placement(i) for i in range(num_layers)]
        shape = (self.layout.group_size, num_blocks * block_size, num_kv_heads, head_dim)
        # zeros, not empty: the whole pool is resident from the start, so memory use is known up front and does not
        # creep up as the prefix cache fills every page
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
    ):
        """Bytes of `block_size` tokens of keys and values in `num_layers` layers (a page: its group's layers)."""
        return (
            2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        )


@dataclass
class KVGroup:
    """The reads and writes of one group of layers (their own block tables). Decode rows attend over
    `decode_tables[i]` (pages, padded with page 0) up to `decode_lengths[i]`, positions counted from the table's
    first page; prefill chunks are (row_start, row_end, page table, start position, context length, position of
    the table's first page): a window kind's tables start at the first page its window may still need."""

    slots: torch.Tensor  # where each row's new key/value is written
    decode_tables: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None  # int64 context length of each decode row, from its table's start
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, W * block_size]: positions below each row's length
    prefills: list[tuple] = field(default_factory=list)
    # masks and window starts built by the first layer that needs them and reused by the others
    cache: dict = field(default_factory=dict)


@dataclass
class PagedBatch:
    """One forward's attention plan, pure data (the model's attention layers read it). The first `num_decode` rows
    are single-token decodes, then prefill chunks; each group of layers has its own tables (`groups`). Built with
    the tables of a single group (the fields below), it describes a pool without windows. A layer with a sliding
    window narrows each row's context itself."""

    pool: KVPool
    slots: torch.Tensor | None = None
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None
    native: object | None = None  # waferscale.kernels.NativeKernels: decode rows read the pool in place
    prefills: list[tuple] = field(default_factory=list)
    groups: list[KVGroup] | None = None

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = [
                KVGroup(self.slots, self.decode_tables, self.decode_lengths, self.decode_mask, self.prefills)
            ]

    def layer(self, layer: int) -> tuple[KVGroup, torch.Tensor, torch.Tensor]:
        """A layer's group plan and its key and value caches ([slots, kv_heads, head_dim])."""
        group, index = self.pool.place[layer]
        return self.groups[group], self.pool.k[index], self.pool.v[index]

    def can_fuse_decode(self, rows: int, head_dim: int) -> bool:
        """Whether this forward is decodes only, so that a layer's rope, KV write and attention can be one call."""
        return self.native is not None and self.num_decode == rows and not self.groups[0].prefills and head_dim <= 512


def prefill_batch(pool: KVPool, num_tokens: int) -> PagedBatch:
    """The plan for one sequence's whole prompt in pages 1, 2, ... of every group (for running the model alone)."""
    slots = torch.arange(num_tokens) + pool.block_size
    table = torch.arange(1, 1 + -(-num_tokens // pool.block_size))
    group = KVGroup(slots, prefills=[(0, num_tokens, table, 0, num_tokens, 0)])
    return PagedBatch(pool, slots, groups=[group] * (max(g for g, _ in pool.place) + 1))
