"""Runs the model on a scheduled batch: builds the PagedBatch (ids, positions, slots, block tables), calls the
forward, and hands back the hidden rows whose logits are needed."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from waferscale.engine.block_manager import BlockManager
from waferscale.engine.kv_cache import KVGroup, KVPool, PagedBatch
from waferscale.engine.scheduler import ScheduledBatch
from waferscale.engine.sequence import Sequence


@dataclass
class ForwardOutput:
    hidden: torch.Tensor
    sample_rows: list[tuple[Sequence, int]] = field(default_factory=list)  # sequences to sample, their row
    score_rows: list[tuple[Sequence, int, int, int]] = field(
        default_factory=list
    )  # prompt logprobs: seq, row, pos, n
    draft_rows: list[tuple[Sequence, int, int]] = field(
        default_factory=list
    )  # seqs with drafts: first row, count


# a chunk runs as decode rows while their attention reads this many positions at most in all: each row reads its
# whole context, and past this the prefill path's one pass over it costs less (the built-in model: 16 rows after
# 4,080 tokens about the same either way)
ROWS_ATTENDED = 32 * 1024


class ModelRunner:
    def __init__(self, model, pool: KVPool, native, blocks: BlockManager, rows_upto: int = 0):
        self.model, self.pool, self.native, self.block_size = model, pool, native, blocks.block_size
        # prefill chunks of at most this many tokens (a short prompt, a cached prompt's tail, the draft model's
        # catching up) run as decode rows: the prefill path's fixed cost is a few decode steps', while each row
        # reads the whole context (ROWS_ATTENDED bounds what they read)
        self.rows_upto = rows_upto
        self.kinds = blocks.kinds
        self.groups = pool.layout.groups
        # the pages of each block (BlockManager.page_map, shared memory: kept current by the block manager); a
        # block's first page names it
        self.page_map = torch.frombuffer(blocks.page_map, dtype=torch.int64).view(-1, blocks.map_width)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _pages(self, blocks: torch.Tensor, r: int) -> torch.Tensor:
        """The pages of group r of these blocks (a block of a one-page kind is its page)."""
        return blocks if r == 0 else self.page_map[blocks, r]

    def forward(self, batch: ScheduledBatch, interrupt: threading.Event | None = None) -> ForwardOutput:
        """One forward over every scheduled token: decode rows first, then each prefill chunk.

        A sequence verifying the drafts of its predicted output runs as decode rows too, one per position (its last
        token, then each draft), each attending up to its own position: the same kernels and the same numbers as
        decoding those tokens one step at a time, so a prediction never changes the answer."""
        verifies, short, prefills = [], [], []  # drafts to verify; chunks run as decode rows; prefill chunks
        for seq, chunk in batch.prefills:
            (verifies if seq.drafts else short if self._as_rows(seq, chunk) else prefills).append((seq, chunk))
        rows: list[tuple[Sequence, int, int]] = []  # decode rows: sequence, position, token
        for seq in batch.decodes:
            p = len(seq.token_ids) - 1
            rows.append((seq, p, seq.token_ids[p]))
        sample_rows: list[tuple[Sequence, int]] = [(s, i) for i, s in enumerate(batch.decodes)]
        draft_rows: list[tuple[Sequence, int, int]] = []
        for seq, chunk in verifies:
            start = seq.num_computed
            draft_rows.append((seq, len(rows), chunk))
            tokens = seq.token_ids[start:] + seq.drafts
            rows.extend((seq, start + j, t) for j, t in enumerate(tokens[:chunk]))
        for seq, chunk in short:
            start = seq.num_computed
            rows.extend((seq, p, seq.token_ids[p]) for p in range(start, start + chunk))
            if start + chunk == len(seq.token_ids):
                sample_rows.append((seq, len(rows) - 1))
        ids = [t for _, _, t in rows]
        positions = [p for _, p, _ in rows]
        row = len(rows)
        score_rows: list[tuple[Sequence, int, int, int]] = []
        chunks: list[tuple[Sequence, int, int, int]] = []  # prefill: sequence, first row, start, end
        for seq, chunk in prefills:
            start = seq.num_computed
            end = start + chunk
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            chunks.append((seq, row, start, end))
            if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
                score_rows.append((seq, row, start, chunk))
            if end == len(seq.token_ids):
                sample_rows.append((seq, row + chunk - 1))
            row += chunk
        kind_plans = [self._kind_plan(k, rows, chunks) for k in range(len(self.kinds))]
        groups = [self._group(kind_plans[k], r, torch.tensor(positions)) for k, r in self.groups]
        paged = PagedBatch(
            self.pool, num_decode=len(rows), native=self.native if rows else None, groups=groups, interrupt=interrupt
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), paged)
        return ForwardOutput(hidden, sample_rows, score_rows, draft_rows)

    def _as_rows(self, seq: Sequence, chunk: int) -> bool:
        """Whether a prefill chunk runs as decode rows: a few tokens, with or without a computed prefix before them,
        and no prompt logprobs (those take the prefill path's scores)."""
        return (
            chunk <= self.rows_upto
            and chunk * (seq.num_computed + chunk) <= ROWS_ATTENDED
            and not seq.params.prompt_logprobs
        )

    def _kind_plan(self, k: int, rows, chunks) -> tuple:
        """One kind's block ids: decode tables and lengths (from each row's first live block), the block each row
        writes, and each prefill chunk's table from its first live block."""
        bs = self.block_size
        writes: list[torch.Tensor] = []
        tables = lengths = None
        if rows:  # lists first, then one tensor each: a decode step's few rows cost more in ops than in data
            lives = [seq.block_tables[k][seq.dropped[k] :] for seq, _, _ in rows]
            width = max(map(len, lives))
            tables = torch.tensor([live + [0] * (width - len(live)) for live in lives], dtype=torch.long)
            ends = [p + 1 - seq.dropped[k] * bs for seq, p, _ in rows]
            lengths = torch.tensor(ends)
            writes.append(torch.tensor([live[(n - 1) // bs] for live, n in zip(lives, ends)], dtype=torch.long))
        prefills = []
        for seq, first_row, start, end in chunks:
            f = seq.dropped[k]
            table = torch.tensor(seq.block_tables[k][f : -(-end // bs)])
            writes.append(table[torch.arange(start, end) // bs - f])
            prefills.append((first_row, first_row + end - start, table, start, end, f * bs))
        return tables, lengths, torch.cat(writes) if writes else torch.zeros(0, dtype=torch.long), prefills

    def _group(self, plan: tuple, r: int, positions: torch.Tensor) -> KVGroup:
        """Group r of a kind: its pages in place of the kind's blocks."""
        tables, lengths, writes, prefills = plan
        bs = self.block_size
        group = KVGroup(self._pages(writes, r) * bs + positions % bs)
        if tables is not None:
            group.decode_tables = self._pages(tables, r).contiguous()
            group.decode_lengths = lengths
            if self.native is None:  # the native kernels stop at each row's length themselves
                group.decode_mask = (torch.arange(tables.shape[1] * bs).unsqueeze(0) < lengths.unsqueeze(1))[
                    :, None, None
                ]
        group.prefills = [(a, b, self._pages(t, r), s, e, f) for a, b, t, s, e, f in prefills]
        return group
