"""Prefix-affinity routing with fake replicas: stable choices, ~1/N of keys moving, the bounded-load escape."""

from __future__ import annotations

import random

from waferscale.engine.block_manager import BlockManager
from waferscale.scale.routing import affinity_key, overloaded, rank, route

KEYS = [f"conversation-{i}" for i in range(4000)]


def owners(replicas: list[str]) -> dict[str, str]:
    return {k: rank(k, replicas)[0] for k in KEYS}


def test_ranking_is_stable_and_independent_of_listing_order():
    replicas = [f"replica-{i}" for i in range(5)]
    shuffled = replicas[:]
    random.Random(3).shuffle(shuffled)
    assert owners(replicas) == owners(shuffled)  # two fronts listing replicas differently still agree
    assert rank("k", replicas) == rank("k", shuffled)


def test_keys_spread_over_replicas():
    replicas = [f"replica-{i}" for i in range(4)]
    counts = {r: 0 for r in replicas}
    for r in owners(replicas).values():
        counts[r] += 1
    assert all(abs(c - len(KEYS) / 4) < 0.1 * len(KEYS) for c in counts.values()), counts


def test_a_replica_joining_or_leaving_moves_about_one_in_n_keys():
    before = [f"replica-{i}" for i in range(4)]
    after = before + ["replica-4"]
    a, b = owners(before), owners(after)
    moved = [k for k in KEYS if a[k] != b[k]]
    assert all(b[k] == "replica-4" for k in moved)  # only keys the newcomer wins move
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.04
    gone = owners(before[1:])  # replica-0 dies: only its keys move
    assert all(gone[k] == a[k] for k in KEYS if a[k] != "replica-0")


def test_affinity_key_follows_the_first_blocks_or_the_cache_key():
    system = list(range(100, 180))  # 5 blocks of 16
    one, two = system + [1, 2, 3], system + [7, 8, 9, 10]
    assert affinity_key(one, None) == affinity_key(two, None)  # same system prompt, different turns
    assert affinity_key(one, None) != affinity_key([5] + one, None)
    assert affinity_key(one, "user-42") == affinity_key([9, 9], "user-42")
    assert affinity_key([1, 2], None) != affinity_key([1, 3], None)  # under one block: the whole prompt
    # the digest is the prefix cache's own key of the 4th block, so any process computes the same one
    assert affinity_key(one, None) == "p:" + BlockManager(4, 16).block_keys(system[:64])[-1].hex()


def test_bounded_load_escapes_a_hot_replica_to_the_next_in_hash_order():
    loads = {f"replica-{i}": 2.0 for i in range(4)}
    key = "hot-system-prompt"
    preferred, second = rank(key, loads)[:2]
    assert route(key, loads)[0] == preferred
    loads[preferred] = 30.0  # well above the mean
    assert overloaded(30.0, loads.values())
    assert route(key, loads) == [r for r in rank(key, loads) if r != preferred] + [preferred]
    assert route(key, loads)[0] == second
    loads[preferred] = 6.0  # a little above the mean is not a reason to lose the cached prefix
    assert route(key, loads)[0] == preferred


def test_equal_loads_keep_the_ranking_however_high():
    loads = {"a": 0.0, "b": 100.0, "c": 0.0}
    key = next(k for k in KEYS if rank(k, loads)[0] == "b")
    assert route(key, loads) == rank(key, loads)[1:] + ["b"]
    assert route(key, {"b": 50.0, "c": 50.0}) == rank(key, ["b", "c"])  # all busy alike: affinity wins
