"""Scheduling priorities (service tiers, batch work below them) on a small block pool, with no model."""

from __future__ import annotations

from fakes import make_seq
from test_scheduler import sched, step

from waferscale.engine.params import BATCH_PRIORITY, TIER_PRIORITY

FLEX, DEFAULT, PRIORITY = TIER_PRIORITY["flex"], TIER_PRIORITY["default"], TIER_PRIORITY["priority"]


def test_a_waiting_request_of_a_higher_tier_is_admitted_first():
    s = sched(max_num_seqs=1)
    s.add(make_seq("run", [1, 2, 3], max_tokens=2))
    step(s)
    flex, default, first = (make_seq(n, [4, 5, 6], priority=p) for n, p in
                            (("flex", FLEX), ("default", DEFAULT), ("priority", PRIORITY)))  # fmt: skip
    for seq in (flex, default, first):
        s.add(seq)
    assert [q.request_id for q in s.waiting] == ["priority", "default", "flex"]


def test_equal_priorities_keep_their_arrival_order():
    s = sched()
    for name in ("a", "b", "c"):
        s.add(make_seq(name, [1, 2], priority=BATCH_PRIORITY))
    s.add(make_seq("i", [1, 2]))
    assert [q.request_id for q in s.waiting] == ["i", "a", "b", "c"]


def test_batch_work_gives_its_slot_to_an_interactive_request():
    s = sched(max_num_seqs=2)
    batch = [make_seq(f"b{i}", [1, 2, 3], max_tokens=50, priority=BATCH_PRIORITY) for i in range(2)]
    for seq in batch:
        s.add(seq)
    step(s)
    assert len(s.running) == 2
    live = make_seq("live", [9, 9, 9], max_tokens=5)
    s.add(live)
    step(s)
    assert live in s.running
    assert batch[1] in s.waiting and batch[0] in s.running  # the newest batch sequence yielded, not failed
    assert s.num_preemptions == 1


def test_batch_work_gives_its_blocks_to_an_interactive_request():
    s = sched(num_blocks=5, block_size=4)  # 4 usable blocks
    hog = make_seq("hog", list(range(12)), max_tokens=50, priority=BATCH_PRIORITY)  # 3 blocks, then a 4th
    s.add(hog)
    step(s)
    live = make_seq("live", list(range(100, 108)), max_tokens=2)  # needs 2 blocks
    s.add(live)
    step(s)
    assert live in s.running and hog in s.waiting
    while not live.finished:
        step(s)
    while not hog.finished and hog.num_generated < 3:
        step(s)
    assert hog in s.running  # resumed once the blocks were free again


def test_an_interactive_request_never_preempts_one_of_its_own_tier():
    s = sched(max_num_seqs=1)
    first = make_seq("first", [1, 2, 3], max_tokens=20)
    s.add(first)
    step(s)
    s.add(make_seq("second", [4, 5, 6]))
    step(s)
    assert s.running == [first] and s.num_preemptions == 0


def test_a_preempted_batch_sequence_resumes_before_later_batch_work():
    s = sched(max_num_seqs=1)
    old = make_seq("old", [1, 2, 3], max_tokens=20, priority=BATCH_PRIORITY)
    s.add(old)
    step(s)
    s.add(make_seq("new", [1, 2, 3], priority=BATCH_PRIORITY))
    s.add(make_seq("live", [7, 7, 7], max_tokens=3))
    step(s)
    assert [q.request_id for q in s.waiting] == ["old", "new"]


def test_batch_work_never_times_out_in_the_queue():
    s = sched(max_num_seqs=1)
    s.add(make_seq("run", [1, 2, 3], max_tokens=20))
    step(s)
    s.queue_timeout = 0.0  # any interactive request waiting now would time out
    waiting = make_seq("batch", [1, 2, 3], priority=BATCH_PRIORITY)
    s.add(waiting)
    step(s)
    assert not waiting.finished and waiting in s.waiting


def _batch_tokens(batch) -> int:
    return sum(1 for q in batch.decodes if q.params.priority == BATCH_PRIORITY) + sum(
        n for q, n in batch.prefills if q.params.priority == BATCH_PRIORITY
    )


def _batch_prefill_rows(batch) -> list:
    return [q for q, _ in batch.prefills if q.params.priority == BATCH_PRIORITY]


def test_beside_interactive_work_batch_work_decodes_a_few_rows_and_prefills_once_in_a_while():
    from waferscale.engine.priorities import (
        BATCH_BESIDE_INTERACTIVE,
        BATCH_PREFILL_EVERY,
        BATCH_STEP_TOKENS,
        BATCH_TOKENS_BESIDE_INTERACTIVE,
    )

    s = sched(num_blocks=256, max_num_seqs=16)
    for i in range(10):
        s.add(make_seq(f"b{i}", [1, 2, i], max_tokens=20, priority=BATCH_PRIORITY))
    step(s)
    s.add(make_seq("live", [9, 9, 9], max_tokens=500))
    prefill_steps, decoded = [], 0
    for n in range(1, 2 * BATCH_PREFILL_EVERY + 1):
        batch = step(s)
        running = [q for q in s.running if q.params.priority == BATCH_PRIORITY]
        assert len(running) <= BATCH_BESIDE_INTERACTIVE
        if _batch_prefill_rows(batch):
            prefill_steps.append(n)
            assert _batch_tokens(batch) <= BATCH_STEP_TOKENS
        else:  # decode rows only: the interactive stream's step stays a step of decodes
            assert _batch_tokens(batch) <= BATCH_TOKENS_BESIDE_INTERACTIVE
            decoded += _batch_tokens(batch)
    assert prefill_steps == [BATCH_PREFILL_EVERY, 2 * BATCH_PREFILL_EVERY]  # the batch moves on, in a thin share
    assert decoded >= 4 * 19


def test_a_batch_prompt_waits_beside_an_interactive_stream_then_prefills_in_one_step():
    from waferscale.engine.priorities import BATCH_PREFILL_EVERY, BATCH_STEP_TOKENS

    s = sched(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512)
    live = make_seq("live", [9, 9, 9], max_tokens=200)
    s.add(live)
    step(s)
    s.add(make_seq("long", list(range(40)), max_tokens=4, priority=BATCH_PRIORITY))
    for _ in range(BATCH_PREFILL_EVERY - 2):
        batch = step(s)
        assert live in batch.decodes and not _batch_prefill_rows(batch)
    batch = step(s)
    assert live in batch.decodes and [n for q, n in batch.prefills if q.request_id == "long"] == [40]
    assert 40 <= BATCH_STEP_TOKENS


def test_without_interactive_work_a_batch_step_stays_short():
    """An interactive request that arrives waits for the step under way: batch work alone takes BATCH_STEP_TOKENS
    tokens a step, not the whole budget (an interactive prompt takes the whole budget)."""
    from waferscale.engine.priorities import BATCH_STEP_TOKENS

    s = sched(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512)
    s.add(make_seq("long", list(range(300)), max_tokens=4, priority=BATCH_PRIORITY))
    assert _batch_tokens(step(s)) == BATCH_STEP_TOKENS < 300
    t = sched(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=512)
    t.add(make_seq("live", list(range(300)), max_tokens=4))
    assert sum(n for _, n in step(t).prefills) == 300


def test_without_interactive_work_batch_sequences_fill_the_slots():
    s = sched(num_blocks=64, max_num_seqs=16)
    for i in range(10):
        s.add(make_seq(f"b{i}", [1, 2, i], max_tokens=20, priority=BATCH_PRIORITY))
    step(s)
    assert len(s.running) == 10 and not s.waiting


def test_running_batch_work_narrows_when_an_interactive_request_arrives():
    from waferscale.engine.priorities import BATCH_BESIDE_INTERACTIVE, BATCH_TOKENS_BESIDE_INTERACTIVE

    s = sched(num_blocks=64, max_num_seqs=16)
    for i in range(10):
        s.add(make_seq(f"b{i}", [1, 2, i], max_tokens=20, priority=BATCH_PRIORITY))
    step(s)
    live = make_seq("live", [9, 9, 9], max_tokens=20)
    s.add(live)
    step(s)
    batch = [q for q in s.running if q.params.priority == BATCH_PRIORITY]
    assert live in s.running and len(batch) == BATCH_BESIDE_INTERACTIVE
    assert [q.request_id for q in batch] == ["b0", "b1", "b2", "b3"]  # the oldest keep running
    while not live.finished:
        batch = step(s)
        assert _batch_prefill_rows(batch) or _batch_tokens(batch) <= BATCH_TOKENS_BESIDE_INTERACTIVE
    step(s)
    assert not s.waiting  # widened again: every remaining batch sequence runs
