"""Scheduler decisions on a small block pool, with no model: a step is schedule(), computed(), then a fake sample."""

from __future__ import annotations

import time

from fakes import make_seq

from waferscale.engine.block_manager import BlockManager
from waferscale.engine.errors import ErrorKind
from waferscale.engine.scheduler import Scheduler


def sched(num_blocks=9, block_size=4, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), **kw)


def step(s: Scheduler, token: int = 7):
    """One engine step without a model: every sequence whose whole context is computed gets `token`."""
    batch = s.schedule()
    s.computed(batch)
    for seq in batch.seqs:
        if seq.remaining == 0:
            seq.token_ids.append(token)
            seq.num_generated += 1
            if seq.num_generated >= seq.params.max_tokens:
                seq.finish_reason = "length"
                s.free(seq)
    s.retire()
    return batch


def until(s: Scheduler, done, steps: int = 50) -> None:
    for _ in range(steps):
        if done():
            return
        step(s)
    raise AssertionError("not reached")


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = sched(max_num_batched_tokens=8)
    seq = make_seq("a", list(range(20)))
    s.add(seq)
    chunks = [step(s).prefills[0][1] for _ in range(3)]
    assert chunks == [8, 8, 4] and seq.num_generated == 1


def test_decodes_come_first_and_a_prefill_takes_the_rest_of_the_budget():
    s = sched(max_num_batched_tokens=8)
    a = make_seq("a", [1, 2, 3], max_tokens=10)
    s.add(a)
    step(s)
    s.add(make_seq("b", list(range(100, 120))))
    batch = step(s)
    assert batch.decodes == [a] and batch.prefills[0][1] == 7


def test_admission_waits_for_free_blocks_then_admits():
    s = sched(num_blocks=5, block_size=4)  # 4 usable blocks
    a = make_seq("a", list(range(12)), max_tokens=2)  # 3 blocks (12 tokens + 1)... then 4
    b = make_seq("b", list(range(50, 58)), max_tokens=1)  # 2 blocks
    s.add(a)
    s.add(b)
    batch = step(s)
    assert [q.request_id for q, _ in batch.prefills] == ["a"] and list(s.waiting) == [b]
    until(s, lambda: b.admitted_once)


def test_batch_size_limit():
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(str(i), [i, i + 1]))
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_the_newest_sequence_is_preempted_when_a_decode_needs_a_block():
    s = sched(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_seq("a", [1, 2, 3, 4], max_tokens=8)
    b = make_seq("b", [5, 6, 7, 8], max_tokens=8)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled, one block each; both now need a second block to decode
    step(s)
    assert s.num_preemptions == 1 and b in s.waiting and b.num_computed == 0 and not b.block_table
    assert a in s.running


def test_a_prompt_that_cannot_fit_the_pool_is_an_invalid_request():
    s = sched(num_blocks=3, block_size=4)  # 8 tokens of cache
    seq = make_seq("big", list(range(20)))
    s.add(seq)
    batch = s.schedule()
    assert batch.ended == [seq] and seq.error.kind is ErrorKind.INVALID_REQUEST and seq.error.param == "prompt"
    assert s.blocks.num_used == 0


def test_a_request_past_the_queue_timeout_is_overloaded():
    s = sched(max_num_seqs=1, queue_timeout=0.01)
    s.add(make_seq("a", [1, 2], max_tokens=50))
    step(s)
    late = make_seq("b", [3, 4])
    late.arrival = time.perf_counter() - 1
    s.add(late)
    batch = s.schedule()
    assert batch.ended == [late] and late.error.kind is ErrorKind.OVERLOADED and s.num_timed_out == 1


def test_max_tokens_zero_ends_at_admission_without_blocks():
    s = sched()
    seq = make_seq("z", [1, 2, 3], max_tokens=0)
    s.add(seq)
    batch = s.schedule()
    assert batch.ended == [seq] and seq.finish_reason == "length" and not batch.prefills


def test_a_second_identical_prompt_waits_for_the_first_and_reuses_its_blocks():
    s = sched(num_blocks=20, block_size=4, max_num_batched_tokens=4)
    prompt = list(range(13))  # 3 full blocks before the last token
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    s.add(a)
    s.add(b)
    batch = step(s)
    assert [q for q, _ in batch.prefills] == [a] and list(s.waiting) == [b]  # deferred, not computed twice
    until(s, lambda: b.admitted_once)
    assert b.num_cached == 12 and b.block_table[:3] == a.block_table[:3]


def test_hit_counters_count_one_admission_once_however_often_it_is_retried():
    s = sched(num_blocks=8, block_size=4, max_num_batched_tokens=64)  # 7 usable blocks
    prompt = list(range(9))  # 2 full blocks before the last token
    a = make_seq("a", prompt, max_tokens=1)
    s.add(a)
    step(s)
    assert (s.blocks.queries, s.blocks.hits) == (2, 0)
    hog = make_seq("hog", list(range(100, 116)), max_tokens=4)  # 5 blocks once it decodes: all but a's 2
    s.add(hog)
    step(s)
    b = make_seq("b", prompt, max_tokens=1)
    s.add(b)
    for _ in range(3):  # b cannot be admitted while the hog holds the pool: retried every step
        step(s)
        assert not b.admitted_once
    until(s, lambda: b.admitted_once)
    assert (s.blocks.queries, s.blocks.hits) == (2 + 3 + 2, 2)  # a, the hog, b: each once
