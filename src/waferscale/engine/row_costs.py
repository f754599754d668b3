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
from collections.abc import Callable, Hashable

import torch

from waferscale import kernels
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.params import SamplingParams
from waferscale.engine.scheduler import ScheduledBatch
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import RowCosts

CONTEXT = 64  # tokens the measured sequence has seen: a short chat's (fewer where the pool holds fewer)
REPEATS = 3  # forwards a size; the fastest counts (the first also warms the size's buffers and kernels up)
_measured: dict[Hashable, RowCosts] = {}


def row_sizes(max_draft: int, max_seqs: int) -> list[int]:
    """The step sizes measured: each of one sequence's (1 to 1 + max_draft rows), then a few up to every sequence
    that speculates with all its drafts."""
    most = max_seqs * (1 + max_draft)
    return sorted(set(range(1, max_draft + 2)) | {r for r in (12, 16, 24, 32, 48, 64) if r < most} | {most})


def measure_row_costs(runner, blocks: BlockManager, logits, sizes: list[int], token: int) -> RowCosts:
    """Times decoding steps of one sequence's rows (sizes) through the model runner (its forward and the rows'
    logits, as verification takes them), in KV blocks taken from the pool and given back."""
    most_rows = max(sizes)
    bs = blocks.block_size
    room = blocks.num_available // sum(kind.pages for kind in blocks.kinds) * bs  # tokens a small pool holds
    context = max(1, min(CONTEXT, room - most_rows))
    per_kind = -(-(context + most_rows) // bs)
    tables = [[blocks.allocate(k) for _ in range(per_kind)] for k in range(len(blocks.kinds))]
    seq = Sequence("row-costs", [token] * context, SamplingParams(max_tokens=most_rows), detokenizer=None)
    seq.block_tables, seq.dropped = tables, [0] * len(tables)
    seconds: dict[int, float] = {}
    try:
        with torch.inference_mode(), kernels.rows_exact():  # as verification steps run
            for rows in sizes:
                seq.num_computed = context - 1
                seq.drafts = [token] * (rows - 1)
                batch = ScheduledBatch(decodes=[seq]) if rows == 1 else ScheduledBatch(prefills=[(seq, rows)])
                best = float("inf")
                for _ in range(REPEATS):
                    start = time.perf_counter()
                    out = runner.forward(batch)
                    torch.log_softmax(logits(out.hidden[:rows]).float(), -1)
                    best = min(best, time.perf_counter() - start)
                seconds[rows] = best
    finally:
        for table in tables:
            blocks.release(table)
    return RowCosts(seconds)


def measured_once(key: Hashable, measure: Callable[[], RowCosts]) -> RowCosts:
    """The table of a model and its settings (key), measured by the first engine of the process that serves them:
    engines started again in one process (tests, a reload) neither wait for it again nor see it change."""
    if key not in _measured:
        _measured[key] = measure()
    return _measured[key]
