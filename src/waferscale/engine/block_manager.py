"""KV-cache pages and blocks: allocation, reference counts, and a prefix cache keyed by a digest of the token
prefix, per kind of layer (whole context, or a sliding window)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

Key = bytes  # a block's prefix key: BLAKE2b of (parent key, the block's token ids)


class BlockKind(NamedTuple):
    """Layers that share a block table: their window (None: the whole context) and the pages one block takes."""

    window: int | None
    pages: int


FULL = (BlockKind(None, 1),)  # a model without windows: one kind, a block is a page


def block_key(parent: Key | None, tokens: list[int] | tuple[int, ...]) -> Key:
    """A cryptographic digest of the parent block's key and this block's token ids: two different prefixes get
    the same key only by a digest collision, which nobody can craft (Python's hash() of a tuple can be)."""
    h = hashlib.blake2b(parent or b"", digest_size=32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def window_start(kind: BlockKind, position: int, block_size: int) -> int:
    """The first block a row at `position` may read in a layer of this kind (0 for the whole context)."""
    if kind.window is None:
        return 0
    return max(0, position - kind.window + 1) // block_size


@dataclass
class PrefixHit:
    """The longest cached prefix every kind can resume from: `blocks` full blocks, and each kind's table for them
    (a window kind's leading entries are 0, the null page: blocks its window no longer sees need not be cached)."""

    blocks: int
    tables: list[list[int]]

    @property
    def reused(self) -> list[int]:
        """The cached blocks taken (every kind's)."""
        return [b for table in self.tables for b in table if b]


class BlockManager:
    """Hands out fixed-size pages; a block of a kind is `kind.pages` pages (one per group of its layers), named by
    its first page. Full blocks are remembered by kind and prefix key and reused until evicted (LRU).

    A cached block also keeps its token ids: a hit is only taken when they equal the tokens asked for, so even a key
    collision can never serve one prompt another prompt's keys and values.
    Page 0 is reserved as the zeroed "null" page that padded attention reads point at.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        kinds: tuple[BlockKind, ...] = FULL,
    ):
        if num_blocks < 1 + max(k.pages for k in kinds):
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size  # num_blocks counts pages
        self.kinds = kinds
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.kind_of = [0] * num_blocks
        self.pages_of: list[tuple[int, ...]] = [(b,) for b in range(num_blocks)]
        # page_map[b * width + r]: the page of group r of block b (the model runner views it as a tensor)
        self.map_width = max(k.pages for k in kinds)
        self.page_map = array("q", [0]) * (num_blocks * self.map_width)
        self.key_of: list[Key | None] = [None] * num_blocks
        self.tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.by_key: list[dict[Key, int]] = [{} for _ in kinds]
        self.free: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, oldest first
        self.evictable_pages = 0
        self.hits = self.queries = 0  # prefix-cache blocks found / looked for, once per admission

    @property
    def num_available(self) -> int:
        """Pages free or holding evictable cached blocks."""
        return len(self.free) + self.evictable_pages

    @property
    def num_used(self) -> int:
        """Pages held by sequences."""
        return self.num_blocks - 1 - self.num_available

    def block_keys(self, tokens: list[int], parent: Key | None = None) -> list[Key]:
        """Chained keys of each full block of `tokens`."""
        out, key, bs = [], parent, self.block_size
        for i in range(len(tokens) // bs):
            key = block_key(key, tokens[i * bs : (i + 1) * bs])
            out.append(key)
        return out

    def _cached(self, kind: int, key: Key, tokens: list[int], i: int) -> int | None:
        b = self.by_key[kind].get(key)
        bs = self.block_size
        if b is None or self.tokens_of[b] != tuple(tokens[i * bs : (i + 1) * bs]):
            return None
        return b

    def match(self, keys: list[Key], tokens: list[int], kind: int = 0) -> list[int]:
        """Blocks of a kind holding the longest cached prefix of these keys whose stored tokens equal `tokens`'."""
        found: list[int] = []
        if not self.enable_prefix_cache:
            return found
        for i, key in enumerate(keys):
            b = self._cached(kind, key, tokens, i)
            if b is None:
                break
            found.append(b)
        return found

    def hit(self, keys: list[Key], tokens: list[int]) -> PrefixHit:
        """The longest prefix every kind has cached: whole-context kinds need each of its blocks, a window kind only
        the blocks the window of the first uncached position sees (a prefix whose window blocks were evicted is not
        a hit, however much of it the other kinds hold)."""
        n = len(keys) if self.enable_prefix_cache else 0
        found: list[list[int | None]] = []
        for k, kind in enumerate(self.kinds):
            if kind.window is None:
                blocks = self.match(keys[:n], tokens, k)
                n = len(blocks)
                found.append(list(blocks))
            else:
                found.append([self._cached(k, key, tokens, i) for i, key in enumerate(keys[:n])])
        for k, kind in enumerate(self.kinds):
            if kind.window is not None:
                bs = self.block_size
                while n and any(b is None for b in found[k][window_start(kind, n * bs, bs) : n]):
                    n -= 1
        tables = []
        for k, kind in enumerate(self.kinds):
            lo = window_start(kind, n * self.block_size, self.block_size)
            tables.append([0] * lo + [b for b in found[k][lo:n]])  # type: ignore[misc]
        return PrefixHit(n, tables)

    def count_lookup(self, queried: int, hit: int) -> None:
        """Record one admission's prefix lookup in the hit-rate counters (retries of an admission do not count)."""
        if self.enable_prefix_cache:
            self.queries += queried
            self.hits += hit

    def can_allocate(self, new_pages: int, reused: list[int]) -> bool:
        """Whether `new_pages` pages can be had besides taking the `reused` cached blocks."""
        reclaimed = sum(
            len(self.pages_of[b]) for b in reused if b and self.ref[b] == 0
        )  # reusing an idle cached block takes it off the shelf
        return new_pages <= self.num_available - reclaimed

    def acquire(self, block: int) -> None:
        if self.ref[block] == 0 and block in self.evictable:
            del self.evictable[block]
            self.evictable_pages -= len(self.pages_of[block])
        self.ref[block] += 1

    def _evict_oldest(self) -> None:
        block, _ = self.evictable.popitem(last=False)
        self.evictable_pages -= len(self.pages_of[block])
        del self.by_key[self.kind_of[block]][self.key_of[block]]
        self.key_of[block] = self.tokens_of[block] = None
        self.free.extend(self.pages_of[block])

    def allocate(self, kind: int = 0) -> int:
        """A block of a kind (its first page names it), evicting the oldest idle cached blocks if pages are short."""
        need = self.kinds[kind].pages
        while len(self.free) < need:
            self._evict_oldest()
        pages = tuple(self.free.popleft() for _ in range(need))
        block = pages[0]
        self.pages_of[block], self.kind_of[block], self.ref[block] = pages, kind, 1
        w = self.map_width
        self.page_map[block * w : block * w + need] = array("q", pages)
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if not b:
                continue  # the null page of a window table's dropped entries
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key_of[b] is not None:
                    self.evictable[b] = None
                    self.evictable_pages += len(self.pages_of[b])
                else:
                    self.free.extend(self.pages_of[b])

    def register(self, block: int, key: Key, tokens: list[int]) -> None:
        """Remember a just-filled block (its key and tokens) so later prompts can share it."""
        by_key = self.by_key[self.kind_of[block]]
        if self.enable_prefix_cache and key not in by_key and self.key_of[block] is None:
            by_key[key] = block
            self.key_of[block] = key
            self.tokens_of[block] = tuple(tokens)
