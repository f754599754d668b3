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
        """One forward over every scheduled token: decode rows first, then each prefill chunk."""
        decodes, prefills = batch.decodes, batch.prefills
        ids, positions, slots = [], [], []
        for seq in decodes:
            p = len(seq.token_ids) - 1
            ids.append(seq.token_ids[p])
            positions.append(p)
        paged = PagedBatch(self.pool, torch.empty(0, dtype=torch.long))
        if decodes:
            lengths = torch.tensor([len(s.token_ids) for s in decodes])
            width = max(len(s.block_table) for s in decodes)
            tables = torch.zeros(len(decodes), width, dtype=torch.long)
            for i, seq in enumerate(decodes):
                tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
            paged.num_decode = len(decodes)
            paged.decode_tables = tables
            paged.decode_lengths = lengths
            paged.native = self.native
            if self.native is None:  # the native kernels stop at each row's length themselves
                paged.decode_mask = (
                    torch.arange(width * self.block_size).unsqueeze(0) < lengths.unsqueeze(1)
                )[:, None, None]
            last = lengths - 1
            slots.append(
                tables[torch.arange(len(decodes)), last // self.block_size] * self.block_size
                + last % self.block_size
            )
        row = len(decodes)
        sample_rows: list[tuple[Sequence, int]] = [(s, i) for i, s in enumerate(decodes)]
        score_rows: list[tuple[Sequence, int, int, int]] = []
        draft_rows: list[tuple[Sequence, int, int]] = []
        for seq, chunk in prefills:
            start = seq.num_computed
            end = start + chunk
            if seq.drafts:  # the last token and the prediction's drafts: every row is sampled
                ids.extend(seq.token_ids[start:] + seq.drafts)
                draft_rows.append((seq, row, chunk))
            else:
                ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(self._slots(seq, start, end))
            table = torch.tensor(seq.block_table[: -(-end // self.block_size)])
            paged.prefills.append((row, row + chunk, table, start, end))
            if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
                score_rows.append((seq, row, start, chunk))
            if end == len(seq.token_ids) and not seq.drafts:
                sample_rows.append((seq, row + chunk - 1))
            row += chunk
        paged.slots = torch.cat(slots)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), paged)
        return ForwardOutput(hidden, sample_rows, score_rows, draft_rows)
