"""KV-cache blocks: allocation, reference counts, and a prefix cache keyed by a digest of the token prefix."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

Key = bytes  # a block's prefix key: BLAKE2b of (parent key, the block's token ids)


def block_key(parent: Key | None, tokens: list[int] | tuple[int, ...]) -> Key:
    """A cryptographic digest of the parent block's key and this block's token ids: two different prefixes get
    the same key only by a digest collision, which nobody can craft (Python's hash() of a tuple can be)."""
    h = hashlib.blake2b(parent or b"", digest_size=32)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Hands out fixed-size blocks; full blocks are remembered by prefix key and reused until evicted (LRU).

    A cached block also keeps its token ids: a hit is only taken when they equal the tokens asked for, so even a key
    collision can never serve one prompt another prompt's keys and values.
    Block 0 is reserved as the zeroed "null" block that padded attention reads point at.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.key_of: list[Key | None] = [None] * num_blocks
        self.tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.by_key: dict[Key, int] = {}
        self.free: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks nobody references, oldest first
        self.hits = self.queries = 0  # prefix-cache blocks found / looked for, once per admission

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_available

    def block_keys(self, tokens: list[int], parent: Key | None = None) -> list[Key]:
        """Chained keys of each full block of `tokens`."""
        out, key, bs = [], parent, self.block_size
        for i in range(len(tokens) // bs):
            key = block_key(key, tokens[i * bs : (i + 1) * bs])
            out.append(key)
        return out

    def match(self, keys: list[Key], tokens: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of these keys whose stored tokens equal `tokens`' blocks."""
        found: list[int] = []
        if not self.enable_prefix_cache:
            return found
        bs = self.block_size
        for i, key in enumerate(keys):
            b = self.by_key.get(key)
            if b is None or self.tokens_of[b] != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            found.append(b)
        return found

    def count_lookup(self, queried: int, hit: int) -> None:
        """Record one admission's prefix lookup in the hit-rate counters (retries of an admission do not count)."""
        if self.enable_prefix_cache:
            self.queries += queried
            self.hits += hit

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
            del self.by_key[self.key_of[block]]
            self.key_of[block] = self.tokens_of[block] = None
        self.ref[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key_of[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def register(self, block: int, key: Key, tokens: list[int]) -> None:
        """Remember a just-filled block (its key and tokens) so later prompts can share it."""
        if self.enable_prefix_cache and key not in self.by_key and self.key_of[block] is None:
            self.by_key[key] = block
            self.key_of[block] = key
            self.tokens_of[block] = tuple(tokens)
