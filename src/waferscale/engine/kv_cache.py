"""Key/value storage in pages shared by the whole batch, how layers are grouped onto them, and the plan of one
forward's reads and writes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from math import gcd

import torch

from waferscale.engine import kv_int8
from waferscale.engine.block_manager import BlockKind
from waferscale.kernels import cpu_has_native_bf16


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


@dataclass(frozen=True)
class LayerKV:
    """One layer's keys and values ([slots, kv_heads, head_dim] each) and, for an int8 pool, their float32 scales
    ([slots, kv_heads, scales]: per token, head and 64 channels, see kv_int8); attention reads them in
    `compute_dtype`."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    compute_dtype: torch.dtype

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows' keys and values ([rows, kv_heads, head_dim]) at their slots (quantized for int8)."""
        if self.k_scale is None:
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
            self.v.index_copy_(0, slots, v.to(self.v.dtype))
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = kv_int8.quantize(x)
            cache.index_copy_(0, slots, q)
            scales.index_copy_(0, slots, s)

    def gather(self, pages: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of these pages in order, [len(pages) * block_size, kv_heads, head_dim] each, in
        compute_dtype (an int8 pool's pages dequantized, a bf16 pool's widened, on the way)."""
        # whole blocks are gathered with index_select (contiguous rows): an order of magnitude faster than advanced
        # indexing, which copies element by element
        heads, dim = self.k.shape[1], self.k.shape[2]
        out = []
        for cache, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = cache.view(-1, block_size * heads * dim).index_select(0, pages).view(-1, heads, dim)
            if scales is not None:
                n = scales.shape[-1]
                s = scales.view(-1, block_size * heads * n).index_select(0, pages).view(-1, heads, n)
                rows = kv_int8.dequantize(rows, s, self.compute_dtype)
            out.append(rows.to(self.compute_dtype))  # a bf16 pool read in float32: only the pages read
        return out[0], out[1]


def kv_cache_dtypes(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The KV pool's storage dtype and the dtype attention computes in, for --kv-cache-dtype. auto: stored in the
    model's dtype; attention computes in it where the CPU multiplies bf16 natively, else in float32 (several times
    faster there; the kernels widen bf16 rows as they read them, so the pool holds as many tokens as where bf16 is
    native); bfloat16 likewise; int8: int8 with scales, read in auto's compute dtype; float32: float32 throughout."""
    compute = model_dtype if cpu_has_native_bf16() else torch.float32
    if kv_cache_dtype == "auto":
        return model_dtype, compute
    if kv_cache_dtype == "int8":
        return torch.int8, compute
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16, compute
    if kv_cache_dtype == "float32":
        return torch.float32, torch.float32
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of auto, bfloat16, float32, int8")


class KVPool:
    """Keys and values of every sequence, in pages: [group_size, pages * block_size, kv_heads, head_dim] each; a
    layer reads the slice of its place in its group (KVLayout). Without windows, one group holds every layer and a
    page is a block of every layer, as a plain paged cache. An int8 pool (dtype torch.int8) also keeps float32 scales
    per token, KV head and 64 channels ([group_size, pages * block_size, kv_heads, kv_int8.num_scales(head_dim)])
    and is read in `compute_dtype`.

    Page 0 stays zero: padded reads point there. The pool is zeroed, so resident, from the start (below).
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
        compute_dtype: torch.dtype | None = None,
    ):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.layout = KVLayout(tuple(windows) if windows is not None else (None,) * num_layers)
        if len(self.layout.windows) != num_layers:
            raise ValueError(f"{len(self.layout.windows)} windows given for {num_layers} layers")
        self.place = [self.layout.placement(i) for i in range(num_layers)]
        self.page_bytes = self.bytes_per_block(self.layout.group_size, num_kv_heads, head_dim, dtype, block_size)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or (torch.float32 if dtype == torch.int8 else dtype)
        shape = (self.layout.group_size, num_blocks * block_size, num_kv_heads, head_dim)
        # zeros, not empty: the whole pool is resident from the start, so memory use is known up front and does not
        # creep up as the prefix cache fills every page
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            scales = (*shape[:3], kv_int8.num_scales(head_dim))
            self.k_scale = torch.zeros(scales, dtype=torch.float32)
            self.v_scale = torch.zeros(scales, dtype=torch.float32)

    @classmethod
    def for_model(cls, cfg, dtype: torch.dtype, compute_dtype: torch.dtype, block_size: int, memory: int) -> KVPool:
        """A pool for a model's layers (grouped by their windows) in `memory` bytes, and never fewer pages than page 0
        and one block of every kind."""
        layout = KVLayout(tuple(cfg.window(i) for i in range(cfg.num_layers)))
        per_page = cls.bytes_per_block(layout.group_size, cfg.num_kv_heads, cfg.head_dim, dtype, block_size)
        pages = max(1 + max(k.pages for k in layout.block_kinds), memory // per_page)
        args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, pages, block_size, layout.windows)
        return cls(*args, compute_dtype)

    def layer_kv(self, index: int) -> LayerKV:
        """The caches of slice `index` of every group."""
        scales = (None, None) if self.k_scale is None else (self.k_scale[index], self.v_scale[index])
        return LayerKV(self.k[index], self.v[index], *scales, self.compute_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (keys, values and any scales)."""
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
    ):
        """Bytes of `block_size` tokens of keys and values in `num_layers` layers (a page: its group's layers),
        with an int8 pool's float32 scales."""
        per_head = head_dim * torch.empty(0, dtype=dtype).element_size()
        if dtype == torch.int8:
            per_head += 4 * kv_int8.num_scales(head_dim)
        return 2 * num_layers * block_size * num_kv_heads * per_head


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


class StepInterrupted(Exception):
    """A forward of batch work stopped between layers for an interactive request that arrived meanwhile."""


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
    interrupt: threading.Event | None = None  # set: the forward stops at the next layer (batch work only)

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = [
                KVGroup(self.slots, self.decode_tables, self.decode_lengths, self.decode_mask, self.prefills)
            ]

    def layer(self, layer: int) -> tuple[KVGroup, LayerKV]:
        """A layer's group plan and its caches."""
        group, index = self.pool.place[layer]
        return self.groups[group], self.pool.layer_kv(index)

    def group(self, layer: int) -> KVGroup:
        """A layer's group plan alone (no views of its caches made)."""
        return self.groups[self.pool.place[layer][0]]

    def check_interrupt(self) -> None:
        """Between layers: raises StepInterrupted once `interrupt` is set. Nothing is committed until the forward
        ends (the engine advances no sequence), and the KV rows written so far are written again, the same, when
        the step is run again."""
        if self.interrupt is not None and self.interrupt.is_set():
            raise StepInterrupted

    def can_fuse_decode(self, rows: int, head_dim: int) -> bool:
        """Whether this forward is decodes only, so that a layer's rope, KV write and attention can be one call."""
        return self.native is not None and self.num_decode == rows and not self.groups[0].prefills and head_dim <= 512


def prefill_batch(pool: KVPool, num_tokens: int) -> PagedBatch:
    """The plan for one sequence's whole prompt in pages 1, 2, ... of every group (for running the model alone)."""
    slots = torch.arange(num_tokens) + pool.block_size
    table = torch.arange(1, 1 + -(-num_tokens // pool.block_size))
    group = KVGroup(slots, prefills=[(0, num_tokens, table, 0, num_tokens, 0)])
    return PagedBatch(pool, slots, groups=[group] * (max(g for g, _ in pool.place) + 1))
