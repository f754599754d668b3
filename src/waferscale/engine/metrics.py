"""Latency histograms kept by the engine thread and rendered by /metrics (Prometheus text format)."""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative-bucket histogram; observe() from one thread, render() from another (reads plain ints)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        running += self.counts[-1]
        lines += [
            f'{name}_bucket{{le="+Inf"}} {running}',
            f"{name}_sum {self.total}",
            f"{name}_count {running}",
        ]
        return lines
