"""A small Ray actor where engine replicas post their stats and fronts read them (per-replica /metrics, the 429
check), so a front sees every replica without calling each one."""

from __future__ import annotations

import time

import ray

REPORT_EVERY_S = 0.5  # how often a replica posts
STALE_AFTER_S = 3.0  # a replica silent this long is dead or gone: it leaves the snapshot


@ray.remote(num_cpus=0)
class StatsBoard:
    """The latest report of each replica: {replica id: (posted at, report dict)}."""

    def __init__(self):
        self.reports: dict[str, tuple[float, dict]] = {}

    def post(self, replica: str, report: dict) -> None:
        self.reports[replica] = (time.monotonic(), report)

    def leave(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def snapshot(self) -> dict[str, dict]:
        """Reports of replicas heard from within STALE_AFTER_S."""
        now = time.monotonic()
        for r in [r for r, (t, _) in self.reports.items() if now - t > STALE_AFTER_S]:
            del self.reports[r]
        return {r: report for r, (_, report) in self.reports.items()}
