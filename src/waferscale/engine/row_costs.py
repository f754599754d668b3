"""What a decoding step costs by its rows, measured once when the engine starts, and the drafts that pay for theirs.

Where a weight format's row kernels are bound by memory (most formats with VNNI or AMX), a step of 9 rows costs little
more than one, and speculation wins whenever drafts are accepted. Where they are bound by compute (`Q4_0`/`Q4_1`
rows without AMX tiles), each row costs a good part of a step, and a draft must be nearly certain to pay. The table is
measured once, before serving, and never changes after: a sequence's drafts depend on its own tokens and acceptance
only, so a seeded request gives the same text each time it is sent (verification rows are not one-row decoding's
numbers in every format, so drafts that followed the step times of the moment would change a sampled text).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from waferscale import kernels
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.params import SamplingParams
from waferscale.engine.scheduler import ScheduledBatch
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import RowCosts

T = TypeVar("T")

CONTEXT = 64  # tokens the measured sequence has seen: a short chat's (fewer where the pool holds fewer)
# forwards a size, in rounds over all the sizes (a stretch of a busy machine then slows one round of each size, not
# every forward of one); the fastest counts (the first round also warms each size's buffers and kernels up)
REPEATS = 3
DRAFT_ROUNDS = 7  # a draft's one-row forward and the target's, timed in turns
_measured: dict[Hashable, object] = {}


def row_sizes(max_draft: int, max_seqs: int) -> list[int]:
    """The step sizes measured: each of one sequence's (1 to 1 + max_draft rows), then a few up to every sequence
    that speculates with all its drafts."""
    most = max_seqs * (1 + max_draft)
    return sorted(set(range(1, max_draft + 2)) | {r for r in (12, 16, 24, 32, 48, 64) if r < most} | {most})


@contextmanager
def _timed_sequence(blocks: BlockManager, most_rows: int, token: int) -> Iterator[Sequence]:
    """A sequence of a short context in KV blocks taken from the pool (given back after), for timing steps of up to
    most_rows rows."""
    bs = blocks.block_size
    room = blocks.num_available // sum(kind.pages for kind in blocks.kinds) * bs  # tokens a small pool holds
    context = max(1, min(CONTEXT, room - most_rows))
    per_kind = -(-(context + most_rows) // bs)
    tables = [[blocks.allocate(k) for _ in range(per_kind)] for k in range(len(blocks.kinds))]
    seq = Sequence("row-costs", [token] * context, SamplingParams(max_tokens=most_rows), detokenizer=None)
    seq.block_tables, seq.dropped = tables, [0] * len(tables)
    try:
        yield seq
    finally:
        for table in tables:
            blocks.release(table)


def _step_seconds(runner, logits, seq: Sequence, rows: int, token: int) -> float:
    """One decoding step of seq's last context token and rows - 1 drafts (its forward and the rows' logits, as
    verification takes them)."""
    seq.num_computed = len(seq.token_ids) - 1
    seq.drafts = [token] * (rows - 1)
    batch = ScheduledBatch(decodes=[seq]) if rows == 1 else ScheduledBatch(prefills=[(seq, rows)])
    start = time.perf_counter()
    out = runner.forward(batch)
    torch.log_softmax(logits(out.hidden[:rows]).float(), -1)
    return time.perf_counter() - start


def measure_row_costs(runner, blocks: BlockManager, logits, sizes: list[int], token: int) -> RowCosts:
    """Times decoding steps of one sequence's rows (sizes) through the model runner, in KV blocks taken from the
    pool and given back."""
    seconds = dict.fromkeys(sizes, float("inf"))
    with _timed_sequence(blocks, max(sizes), token) as seq, torch.inference_mode(), kernels.rows_exact():
        for _ in range(REPEATS):
            for rows in sizes:
                seconds[rows] = min(seconds[rows], _step_seconds(runner, logits, seq, rows, token))
    return RowCosts(seconds)


def draft_cost_ratio(target, draft, token: int) -> float:
    """A draft model's one-row forward over its target's one-row step; target and draft are (runner, blocks,
    logits). Timed in turns, so that a busy stretch of the machine (a server's start) slows both sides alike rather
    than one: whether a draft pays at all turns on this ratio."""
    best = [float("inf"), float("inf")]
    with (
        _timed_sequence(target[1], 1, token) as t_seq,
        _timed_sequence(draft[1], 1, token) as d_seq,
        torch.inference_mode(),
        kernels.rows_exact(),
    ):
        for _ in range(DRAFT_ROUNDS):
            best[0] = min(best[0], _step_seconds(target[0], target[2], t_seq, 1, token))
            best[1] = min(best[1], _step_seconds(draft[0], draft[2], d_seq, 1, token))
    return best[1] / best[0]


def measured_once(key: Hashable, measure: Callable[[], T]) -> T:
    """The table of a model and its settings (key), measured by the first engine of the process that serves them:
    engines started again in one process (tests, a reload) neither wait for it again nor see it change."""
    if key not in _measured:
        _measured[key] = measure()
    return _measured[key]  # type: ignore[return-value]
