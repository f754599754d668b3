"""Block accounting with sliding-window layers, no model: a whole-context kind and a window kind draw pages from one
pool, a sequence holds window blocks for its window only, and a prefix hit needs the window's blocks cached."""

from __future__ import annotations

from fakes import make_seq

from waferscale.engine.block_manager import BlockKind, BlockManager
from waferscale.engine.kv_cache import KVLayout
from waferscale.engine.scheduler import Scheduler

FULL, WINDOW = BlockKind(None, 1), BlockKind(8, 3)  # one whole-context group, three window groups (block size 4)


def manager(pages: int = 40) -> BlockManager:
    return BlockManager(pages, 4, kinds=(FULL, WINDOW))


def fill(bm: BlockManager, kind: int, tokens: list[int]) -> list[int]:
    """Allocate and register a kind's blocks for the full blocks of `tokens`, as a finished prefill would."""
    keys = bm.block_keys(tokens)
    blocks = [bm.allocate(kind) for _ in keys]
    for i, (b, k) in enumerate(zip(blocks, keys)):
        bm.register(b, k, tokens[i * 4 : (i + 1) * 4])
    return blocks


def test_the_layout_groups_layers_by_the_gcd_of_the_kinds_counts():
    """Gemma 3 270M: 18 layers, every 6th global -> groups of 3 layers, a window block is 5 pages."""
    windows = tuple(None if i % 6 == 5 else 512 for i in range(18))
    layout = KVLayout(windows)
    assert layout.group_size == 3 and layout.block_kinds == (BlockKind(None, 1), BlockKind(512, 5))
    assert layout.placement(5) == (0, 0) and layout.placement(17) == (0, 2)  # the global layers: group 0
    assert layout.placement(0) == (1, 0) and layout.placement(4) == (2, 1)  # local layers 0-2, 3-4 ...
    assert KVLayout((None,) * 4).block_kinds == (BlockKind(None, 1),)  # no window: a block is a page


def test_a_window_block_takes_its_pages_and_gives_them_all_back():
    bm = manager(10)  # 9 usable pages
    b = bm.allocate(1)
    pages = bm.pages_of[b]
    assert len(pages) == 3 and pages[0] == b and bm.num_used == 3 and bm.num_available == 6
    assert list(bm.page_map[b * 3 : b * 3 + 3]) == list(pages)
    bm.release([b])
    assert bm.num_used == 0 and bm.num_available == 9


def test_allocating_evicts_idle_cached_blocks_until_the_pages_suffice():
    bm = manager(5)  # 4 usable pages
    singles = fill(bm, 0, list(range(12)))  # three one-page cached blocks
    bm.release(singles)
    assert bm.num_available == 4 and bm.evictable_pages == 3
    bm.allocate(1)  # 3 pages: the free one and the two oldest cached blocks
    assert bm.num_used == 3 and bm.evictable_pages == 1
    assert bm.match(bm.block_keys(list(range(12))), list(range(12))) == []  # the first block was evicted


def test_a_prefix_hit_takes_the_window_blocks_it_still_sees_and_null_before_them():
    bm = manager()
    tokens = list(range(24))  # 6 blocks
    full, window = fill(bm, 0, tokens), fill(bm, 1, tokens)
    bm.release(full)
    bm.release(window)
    hit = bm.hit(bm.block_keys(tokens + [99]), tokens + [99])
    # resuming at position 24, a window of 8 sees positions 17..: blocks 4 and 5
    assert hit.blocks == 6 and hit.tables[0] == full and hit.tables[1] == [0, 0, 0, 0] + window[4:]
    assert hit.reused == full + window[4:]


def test_a_prefix_whose_window_blocks_were_evicted_is_not_a_hit_there():
    bm = manager()
    tokens = list(range(24))
    full, window = fill(bm, 0, tokens), fill(bm, 1, tokens)
    bm.release(window[:3])  # blocks 0-2 idle first: the oldest, so evicted first
    bm.release(window[3:])
    bm.release(full)
    keys = bm.block_keys(tokens + [99])
    assert bm.hit(keys, tokens + [99]).blocks == 6  # the window of position 24 needs blocks 4, 5 only
    for _ in range(3):
        bm._evict_oldest()
    # window blocks 0-2 gone: a hit at block 6 still stands (it needs 4, 5), shorter ones whose window needs them
    # do not, and a longer prompt with another tail still resumes at 6
    assert bm.hit(keys[:3], tokens[:12] + [99]).blocks == 0  # resuming at 12 needs blocks 1, 2
    bm._evict_oldest()  # window block 3
    hit = bm.hit(keys, tokens + [99])
    assert hit.blocks == 6 and hit.tables[1][4:] == window[4:]
    bm._evict_oldest()  # window block 4: now no resumption point has its whole window cached
    assert bm.hit(keys, tokens + [99]).blocks == 0


def sched(pages: int = 64, **kw) -> Scheduler:
    return Scheduler(manager(pages), **kw)


def step(s: Scheduler, token: int = 7):
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


def live(seq, kind: int) -> list[int]:
    return [b for b in seq.block_tables[kind] if b]


def test_a_long_sequence_holds_window_blocks_for_its_window_only():
    s = sched(pages=200, max_num_batched_tokens=8)
    seq = make_seq("a", list(range(40)), max_tokens=60)
    s.add(seq)
    most = 0
    while not seq.finished:
        step(s)
        if not seq.finished:
            assert len(seq.block_tables[0]) == -(-max(seq.num_computed, 40) // 4)  # the whole context
            most = max(most, len(live(seq, 1)))
    # a chunk of 8 and the 7 positions before it span at most 5 blocks of 4
    assert most <= s.window_blocks(8) == 5
    assert s.blocks.num_used == 0


def test_dropped_window_blocks_stay_cached_for_a_later_prompt():
    s = sched(pages=200, max_num_batched_tokens=8)
    prompt = list(range(30))
    a = make_seq("a", prompt, max_tokens=1)
    s.add(a)
    for _ in range(3):
        step(s)
    assert a.dropped[1] == 2  # the third chunk starts at 16, whose window sees from position 9 (block 2) on
    while not a.finished:
        step(s)
    b = make_seq("b", prompt + [1, 2, 3], max_tokens=5)
    s.add(b)
    step(s)
    assert b.num_cached == 28  # 7 blocks: the whole-context ones, and the window's last blocks
    assert b.block_tables[1][:5] == [0] * 5 and all(b.block_tables[1][5:7])


def test_admission_counts_the_pages_of_each_kind_for_the_first_chunk_only():
    """A 64-token prompt in chunks of 8: 16 whole-context pages, and window pages for the first chunk (2 blocks of
    3 pages); later chunks hold the window's blocks behind them too (4 blocks at most here), never the whole
    prompt's 16."""
    s = sched(pages=32, max_num_batched_tokens=8)
    seq = make_seq("a", list(range(64)), max_tokens=3)
    s.add(seq)
    step(s)
    assert s.running == [seq] and s.blocks.num_used == 16 + 2 * 3
    most = 0
    while not seq.finished:
        step(s)
        most = max(most, s.blocks.num_used)
    assert seq.num_generated == 3 and s.num_preemptions == 0 and most == 16 + 4 * 3


def test_a_prompt_whose_whole_context_part_cannot_fit_is_refused():
    s = sched(pages=24, max_num_batched_tokens=8)
    seq = make_seq("a", list(range(200)))
    s.add(seq)
    batch = s.schedule()
    assert batch.ended == [seq] and "holds" in seq.error.message
