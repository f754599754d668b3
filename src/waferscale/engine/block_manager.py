"""KV-cache blocks: allocation, reference counts, and prefix caching keyed by a hash of the token prefix."""

from __future__ import annotations

from collections import OrderedDict, deque


class BlockManager:
    """Hands out fixed-size blocks; full blocks are remembered by prefix hash and reused until evicted (LRU).

    Block 0 is reserved as the zeroed "null" block that padded attention reads point at.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks nobody references, oldest first
        self.hits = self.queries = 0  # prefix-cache blocks found / looked for

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_available

    def block_hashes(self, tokens: list[int], parent: int | None = None) -> list[int]:
        """Chained hashes of each full block of `tokens`."""
        out, h, bs = [], parent, self.block_size
        for i in range(len(tokens) // bs):
            h = hash((h, tuple(tokens[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    def match(self, hashes: list[int], count: bool = True) -> list[int]:
        """Blocks holding the longest cached prefix of these block hashes (`count`: in the hit-rate counters)."""
        found: list[int] = []
        if not self.enable_prefix_cache:
            return found
        if count:
            self.queries += len(hashes)
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            found.append(b)
        if count:
            self.hits += len(found)
        return found

    def can_allocate(self, new_blocks: int, reused: list[int]) -> bool:
        reclaimed = sum(
            1 for b in reused if self.ref[b] == 0
        )  # reusing an idle cached block takes it off the shelf
        return new_blocks <= self.num_available - reclaimed

    def acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            self.evictable.pop(block, None)
        self.ref[block] += 1

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of[block]]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def register(self, block: int, h: int) -> None:
        """Remember a just-filled block under its prefix hash so later prompts can share it."""
        if self.enable_prefix_cache and h not in self.by_hash and self.hash_of[block] is None:
            self.by_hash[h] = block
            self.hash_of[block] = h
