"""Plain numbers the engine keeps for monitoring, handed over as a snapshot (the API layer renders them)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class HistogramSnapshot:
    buckets: tuple[float, ...]  # upper bounds, +Inf implied
    counts: list[int]  # per bucket (not cumulative), the last one past the largest bound
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Bucketed latencies; observe() on the engine thread, snapshot() from any thread (reads plain ints)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.buckets, list(self.counts), self.total)


@dataclass
class EngineStats:
    """What the engine reports: gauges (now) and counters (since start)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_cache_bytes: int = 0  # the pool's memory (keys, values and an int8 pool's scales)
    kv_cache_tokens: int = 0  # tokens whose keys and values the pool holds in every layer
    prefix_cache_queries: int = 0  # counters from here on
    prefix_cache_hits: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    queue_timeouts: int = 0
    failed_steps: int = 0
    interrupted_steps: int = 0  # steps of batch work stopped between layers for an interactive arrival
    speculative_draft_tokens: int = 0  # tokens the server's own speculation proposed (not a client's prediction)
    speculative_accepted_tokens: int = 0  # and how many of them the model confirmed
    ttft: HistogramSnapshot | None = None  # arrival to first token
    itl: HistogramSnapshot | None = None  # between consecutive tokens of a sequence
    expert_load: dict[int, list[int]] = field(default_factory=dict)  # sparse layer -> rows routed to each expert

    GAUGES = (
        "running", "waiting", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "kv_cache_bytes",
        "kv_cache_tokens",
    )  # fmt: skip
    COUNTERS = (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "generated_tokens",
        "preemptions",
        "queue_timeouts",
        "failed_steps",
        "interrupted_steps",
        "speculative_draft_tokens",
        "speculative_accepted_tokens",
    )
