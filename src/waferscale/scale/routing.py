"""Prefix-affinity routing: which replica a request should go to, from its affinity key and the replicas' loads.

Pure functions, no Ray: the affinity key is the request's prompt_cache_key, else the digest of its first prompt
blocks (engine/block_manager.block_key, the BLAKE2b chain the prefix cache uses, so every process computes the same
key for the same tokens). Replicas are ranked by rendezvous (highest-random-weight) hashing, so every front agrees
on the ranking without shared state and a replica that comes or goes moves only the keys it wins (~1/N). Bounded
load: a replica whose waiting work is well above the mean is skipped for the next one in the key's ranking, so one
hot prefix cannot pile a queue onto one replica while others idle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from waferscale.engine.block_manager import block_key

AFFINITY_BLOCKS = 4  # prompt blocks in the digest: enough to tell system prompts apart, short of the user turn
LOAD_FACTOR = 1.5  # a replica is "well above the mean" past mean * LOAD_FACTOR + LOAD_SLACK waiting sequences
LOAD_SLACK = 4


def affinity_key(
    prompt_ids: list[int], cache_key: str | None, block_size: int = 16, blocks: int = AFFINITY_BLOCKS
) -> str:
    """The routing key: the client's prompt_cache_key when given, else the prefix cache's digest of the prompt's
    first `blocks` full blocks (of the whole prompt when it is shorter than a block)."""
    if cache_key is not None:
        return "k:" + hashlib.blake2b(cache_key.encode(), digest_size=16).hexdigest()
    key = None
    full = min(blocks, len(prompt_ids) // block_size)
    for i in range(full):
        key = block_key(key, prompt_ids[i * block_size : (i + 1) * block_size])
    if key is None:
        key = block_key(None, prompt_ids)
    return "p:" + key.hex()


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


def rank(key: str, replicas: Iterable[str]) -> list[str]:
    """Replica ids in the key's order of preference (highest rendezvous weight first); ties cannot change it."""
    return sorted(replicas, key=lambda r: (-_weight(key, r), r))


def overloaded(load: float, loads: Iterable[float]) -> bool:
    """Whether `load` is well above the mean of `loads` (the bounded-load rule)."""
    values = list(loads)
    mean = sum(values) / len(values) if values else 0.0
    return load > mean * LOAD_FACTOR + LOAD_SLACK


def route(key: str, loads: Mapping[str, float]) -> list[str]:
    """Replica ids to try in order: the key's ranking with replicas over the load bound moved to the end (in their
    ranked order), so the preferred replica takes the key unless it is a hot spot."""
    order = rank(key, loads)
    fine = [r for r in order if not overloaded(loads[r], loads.values())]
    return fine + [r for r in order if r not in fine]
