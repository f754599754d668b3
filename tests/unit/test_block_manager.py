"""BlockManager alone: allocation, reference counts, prefix reuse, LRU eviction and key collisions."""

from __future__ import annotations

import pytest

from waferscale.engine import block_manager
from waferscale.engine.block_manager import BlockManager, block_key


def fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and register the full blocks of `tokens` as a finished prefill would; return the blocks."""
    keys = bm.block_keys(tokens)
    blocks = [bm.allocate() for _ in keys]
    for i, (b, k) in enumerate(zip(blocks, keys)):
        bm.register(b, k, tokens[i * bm.block_size : (i + 1) * bm.block_size])
    return blocks


def test_block_zero_is_never_handed_out_and_counts_add_up():
    bm = BlockManager(5, 4)
    got = [bm.allocate() for _ in range(4)]
    assert sorted(got) == [1, 2, 3, 4] and bm.num_available == 0 and bm.num_used == 4
    bm.release(got)
    assert bm.num_available == 4 and bm.num_used == 0
    with pytest.raises(ValueError):
        BlockManager(1, 4)


def test_keys_are_digests_chained_from_the_parent():
    bm = BlockManager(8, 2)
    keys = bm.block_keys([1, 2, 3, 4, 5])
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert keys[1] == block_key(keys[0], [3, 4])
    assert bm.block_keys([9, 9, 3, 4])[1] != keys[1]  # same block, other parent: other key


def test_a_released_prefix_is_reused_with_its_tokens():
    bm = BlockManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = fill(bm, tokens)
    bm.release(blocks)
    assert bm.num_available == 7 and len(bm.evictable) == 3
    other = [1, 2, 3, 4, 7, 7]
    assert bm.match(bm.block_keys(other), other) == blocks[:2]


def test_eviction_takes_the_oldest_idle_cached_block_and_forgets_its_key():
    bm = BlockManager(4, 2)  # three usable blocks
    a, b = fill(bm, [1, 1]), fill(bm, [2, 2])
    bm.release(a)
    bm.release(b)
    c = bm.allocate()  # the one free block
    assert c not in a + b
    d = bm.allocate()  # no free block left: the oldest cached one (a) is evicted
    assert [d] == a
    assert bm.match(bm.block_keys([1, 1]), [1, 1]) == []
    assert bm.match(bm.block_keys([2, 2]), [2, 2]) == b


def test_a_reused_idle_block_leaves_the_eviction_list():
    bm = BlockManager(3, 2)
    a = fill(bm, [1, 1])
    bm.release(a)
    assert bm.can_allocate(1, a) and not bm.can_allocate(2, a)
    bm.acquire(a[0])
    assert a[0] not in bm.evictable and bm.ref[a[0]] == 1


def test_a_colliding_key_never_serves_another_prompts_blocks(monkeypatch):
    """Inject a collision (every block gets the same key): the stored token ids are compared before reuse."""
    monkeypatch.setattr(block_manager, "block_key", lambda parent, tokens: b"collision")
    bm = BlockManager(8, 2)
    victim = [10, 11, 12, 13]
    blocks = fill(bm, victim)
    attacker = [20, 21, 22, 23]
    keys = bm.block_keys(attacker)
    assert keys == bm.block_keys(victim)  # the keys collide...
    assert bm.match(keys, attacker) == []  # ...but nothing is reused
    assert bm.match(keys, victim) == blocks[:1]  # (the chain: both blocks share the key, the second is a miss)


def test_old_hash_keys_could_collide_digest_keys_do_not():
    """hash() of ints wraps modulo 2**61 - 1: token tuples that differ can hash alike. Digests do not."""
    p = 2**61 - 1
    assert hash((None, (1, 2))) == hash((None, (1 + p, 2)))  # the old key of two different blocks
    bm = BlockManager(8, 2)
    assert bm.block_keys([1, 2]) != bm.block_keys([1 + p, 2])


def test_hit_counters_count_what_they_are_told_once():
    bm = BlockManager(8, 2)
    bm.count_lookup(3, 2)
    assert (bm.queries, bm.hits) == (3, 2)
    BlockManager(8, 2, enable_prefix_cache=False).count_lookup(3, 2)
