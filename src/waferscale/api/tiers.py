"""Service tiers of interactive requests: `priority` > `default` > `flex` as engine priorities (batch work runs below
them all), `auto` served at `default`, and the `queue_threshold` header that refuses a `flex` or `auto` request up
front when the rolling average queue time of recent requests is over it."""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from fastapi import Request

from waferscale.api.batch_runner import with_priority
from waferscale.api.errors import APIError
from waferscale.api.pipeline import Run
from waferscale.engine.params import TIER_PRIORITY

THRESHOLD_HEADER = "queue_threshold"
MIN_THRESHOLD, MAX_THRESHOLD = 50, 20_000  # milliseconds
WINDOW = 30.0  # seconds of recent requests the rolling average covers
THRESHOLD_TIERS = ("flex", "auto")


class QueueTimes:
    """Queue times (arrival to first admission) of the requests that ended in the last WINDOW seconds."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._times: deque[tuple[float, float]] = deque(maxlen=256)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._times.append((self.clock(), seconds))

    def average(self) -> float:
        """The rolling average in seconds; 0 when no request ended recently (an idle server queues nothing)."""
        now = self.clock()
        with self._lock:
            while self._times and now - self._times[0][0] > WINDOW:
                self._times.popleft()
            values = [t for _, t in self._times]
        return sum(values) / len(values) if values else 0.0


def parse_threshold(raw: str | None) -> int | None:
    """The header's milliseconds, or a 400 naming the accepted range."""
    if raw is None:
        return None
    value = int(raw) if raw.strip().isdigit() else -1
    if not MIN_THRESHOLD <= value <= MAX_THRESHOLD:
        raise APIError(
            400,
            f"queue_threshold must be a whole number of milliseconds from {MIN_THRESHOLD} to {MAX_THRESHOLD} "
            f"(got {raw!r})",
            param="queue_threshold",
            code="invalid_queue_threshold",
        )
    return value


def admit(request: Request, tier: str | None, run: Run, queue: QueueTimes) -> str:
    """Schedule `run` at its tier's priority, or refuse it (429) when it is `flex`/`auto` with a queue_threshold
    the current rolling average queue time exceeds. Returns the tier that serves it."""
    tier = tier or "default"
    used = "default" if tier == "auto" else tier
    if tier in THRESHOLD_TIERS:
        threshold = parse_threshold(request.headers.get(THRESHOLD_HEADER))
        expected = queue.average()
        if threshold is not None and expected * 1000 > threshold:
            raise APIError(
                429,
                f"the expected queue time ({expected * 1000:.0f} ms, the average of the last {WINDOW:.0f} s) is over "
                f"this request's queue_threshold of {threshold} ms; retry later, raise the threshold, or use "
                "service_tier default",
                param="queue_threshold",
                code="queue_threshold_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(expected)))},
            )
    with_priority(run, TIER_PRIORITY[used])
    return used


def observe(run: Run, queue: QueueTimes) -> None:
    """Add run's queue time to `queue` when it ends (after whatever else runs then)."""
    before = run.on_finish

    def finished(r: Run) -> None:
        if before is not None:
            before(r)
        if any(s.last is not None and s.last.error is None for s in r.seqs):
            queue.add(r.time_info()["queue_time"])

    run.on_finish = finished
