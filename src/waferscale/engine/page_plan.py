"""How many KV pages a sequence needs, per block kind: whole-context kinds hold every block of the sequence, window
kinds only what their window and the next chunk span (older blocks are given back as the sequence moves on).
Plain arithmetic over BlockManager.kinds, shared by admission, growth and the capacity the engine reports."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from waferscale.engine.block_manager import BlockKind, BlockManager, PrefixHit, window_start
from waferscale.engine.sequence import Sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagePlan:
    """The page arithmetic of one pool: its block kinds, block size and the most tokens one step computes."""

    def __init__(self, blocks: BlockManager, chunk_tokens: int):
        self.blocks = blocks
        self.kinds: list[BlockKind] = list(blocks.kinds)
        self.block_size = blocks.block_size
        self.chunk_tokens = chunk_tokens

    def targets(self, num_tokens: int, end: int) -> list[int]:
        """Blocks each kind's table must reach for a sequence of `num_tokens` tokens computed up to `end`: the
        whole-context kinds hold the whole prompt from admission on, window kinds only what the next chunk writes."""
        full, upto = ceil_div(num_tokens, self.block_size), ceil_div(end, self.block_size)
        return [full if kind.window is None else upto for kind in self.kinds]

    def missing_pages(self, targets: list[int], tables: Seq[list[int]]) -> int:
        """Pages still to allocate for tables to reach targets."""
        return sum(max(0, t - len(table)) * kind.pages for t, table, kind in zip(targets, tables, self.kinds))

    def admission_pages(self, prompt_len: int, start: int, tables: Seq[list[int]], budget: int) -> int:
        """New pages a sequence of `prompt_len` tokens needs to start from `start` (a prefix hit's tables) and run
        its first chunk of at most `budget` tokens."""
        end = start + min(prompt_len - start, budget)
        return self.missing_pages(self.targets(prompt_len, end), tables)

    def start(self, seq: Sequence, hit: PrefixHit) -> None:
        """Seq begins from a prefix hit: the hit's blocks (acquired) as its tables, computed up to the hit."""
        for b in hit.reused:
            self.blocks.acquire(b)
        bs = self.block_size
        seq.block_tables = [list(t) for t in hit.tables]
        seq.dropped = [window_start(kind, hit.blocks * bs, bs) for kind in self.kinds]
        seq.num_computed = hit.blocks * bs

    def grow(self, seq: Sequence, targets: list[int]) -> None:
        """Allocate the blocks seq's tables lack to reach targets (the caller checked there is room)."""
        for k, table in enumerate(seq.block_tables):
            table += [self.blocks.allocate(k) for _ in range(targets[k] - len(table))]

    def window_blocks(self, window: int) -> int:
        """The most blocks a window kind holds for one sequence: its window plus a chunk, and a partial block."""
        return ceil_div(window - 1 + self.chunk_tokens, self.block_size) + 1

    def sequence_pages(self, num_tokens: int) -> int:
        """The most pages a sequence of `num_tokens` tokens holds at once: every block of the whole-context kinds,
        and of a window kind what a chunk and the window behind it span."""
        blocks = ceil_div(num_tokens, self.block_size)
        pages = 0
        for kind in self.kinds:
            held = blocks if kind.window is None else min(blocks, self.window_blocks(kind.window))
            pages += held * kind.pages
        return pages

    def capacity_tokens(self) -> int | None:
        """The longest sequence the pool holds (None: any length, where every layer has a window)."""
        reserve = sum(self.window_blocks(k.window) * k.pages for k in self.kinds if k.window is not None)
        full = sum(k.pages for k in self.kinds if k.window is None)
        if not full:
            return None
        return max(0, self.blocks.num_blocks - 1 - reserve) // full * self.block_size

    def drop_out_of_window(self, seq: Sequence) -> None:
        """Give back the window kinds' blocks that no row from seq's next position on can see (the cached ones stay
        in the prefix cache until evicted)."""
        for k, kind in enumerate(self.kinds):
            if kind.window is None or not seq.block_tables:
                continue
            table = seq.block_tables[k]
            first, lo = seq.dropped[k], min(window_start(kind, seq.num_computed, self.block_size), len(table))
            if lo > first:
                self.blocks.release(table[first:lo])
                table[first:lo] = [0] * (lo - first)
                seq.dropped[k] = lo
