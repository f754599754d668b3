"""Runs the model on a scheduled batch: builds the PagedBatch (ids, positions, slots, block tables), calls the
forward, and hands back the hidden rows whose logits are needed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from waferscale.engine.kv_cache import KVPool, PagedBatch
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


class ModelRunner:
    def __init__(self, model, pool: KVPool, native, block_size: int):
        self.model, self.pool, self.native, self.block_size = model, pool, native, block_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        """One forward over every scheduled token: decode rows first, then each prefill chunk.

        A sequence verifying the drafts of its predicted output runs as decode rows too, one per position (its last
        token, then each draft), each attending up to its own position: the same kernels and the same numbers as
        decoding those tokens one step at a time, so a prediction never changes the answer."""
        verifies = [(seq, chunk) for seq, chunk in batch.prefills if seq.drafts]
        prefills = [(seq, chunk) for seq, chunk in batch.prefills if not seq.drafts]
        rows: list[tuple[Sequence, int, int]] = []  # decode rows: sequence, position, token
        for seq in batch.decodes:
            p = len(seq.token_ids) - 1
            rows.append((seq, p, seq.token_ids[p]))
        draft_rows: list[tuple[Sequence, int, int]] = []
        for seq, chunk in verifies:
            start = seq.num_computed
            draft_rows.append((seq, len(rows), chunk))
            tokens = seq.token_ids[start:] + seq.drafts
            rows.extend((seq, start + j, t) for j, t in enumerate(tokens[:chunk]))
        ids = [t for _, _, t in rows]
        positions = [p for _, p, _ in rows]
        slots = []
        paged = PagedBatch(self.pool, torch.empty(0, dtype=torch.long))
        if rows:
            lengths = torch.tensor([p + 1 for _, p, _ in rows])
            width = max(len(s.block_table) for s, _, _ in rows)
            tables = torch.zeros(len(rows), width, dtype=torch.long)
            for i, (seq, _, _) in enumerate(rows):
                tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
            paged.num_decode = len(rows)
            paged.decode_tables = tables
            paged.decode_lengths = lengths
            paged.native = self.native
            if self.native is None:  # the native kernels stop at each row's length themselves
                paged.decode_mask = (
                    torch.arange(width * self.block_size).unsqueeze(0) < lengths.unsqueeze(1)
                )[:, None, None]
            last = lengths - 1
            slots.append(
                tables[torch.arange(len(rows)), last // self.block_size] * self.block_size
                + last % self.block_size
            )
        row = len(rows)
        sample_rows: list[tuple[Sequence, int]] = [(s, i) for i, s in enumerate(batch.decodes)]
        score_rows: list[tuple[Sequence, int, int, int]] = []
        for seq, chunk in prefills:
            start = seq.num_computed
            end = start + chunk
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(self._slots(seq, start, end))
            table = torch.tensor(seq.block_table[: -(-end // self.block_size)])
            paged.prefills.append((row, row + chunk, table, start, end))
            if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
                score_rows.append((seq, row, start, chunk))
            if end == len(seq.token_ids):
                sample_rows.append((seq, row + chunk - 1))
            row += chunk
        paged.slots = torch.cat(slots)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), paged)
        return ForwardOutput(hidden, sample_rows, score_rows, draft_rows)
