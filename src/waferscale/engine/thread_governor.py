"""Picks how many OpenMP threads each decode step runs on, from the step times it measures.

On a CPU of its own the engine decodes fastest on every thread, its OpenMP workers spinning at the barriers that
end each of a step's hundreds of parallel regions. When another process takes a core, a spinning worker holds a
core that the worker it waits for needs, and each barrier can wait a scheduler time slice: decoding collapses to a
tenth or less. Fewer threads (down to one, which has no barriers) then decode faster. The governor probes the other
thread counts for a few steps now and then (one step, where that one is clearly slower), and sooner when step
times grow, and keeps whichever is faster: all threads on a quiet machine, fewer on a busy one, all again once the
other work stops.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable

log = logging.getLogger("waferscale.engine")


class ThreadGovernor:
    """Chooses the thread count of each measured step (`threads_for`) and learns from its time (`record`).

    Steps are compared only with steps of the same key (the caller's: e.g. the batch size's power of two); a key
    of None marks a step that is neither measured nor probed (a prefill). `set_threads` applies a count (PyTorch's
    `torch.set_num_threads` on the engine's thread, which also sizes the native kernels' OpenMP teams).
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        *,
        period: int = 64,
        max_period: int = 512,
        probe_steps: int = 3,
        margin: float = 0.15,
        slowdown: float = 1.5,
        abandon: float = 1.3,
        applied: Callable[[], int] | None = None,
    ):
        self.candidates = sorted({max_threads, max(1, max_threads // 2), 1}, reverse=True)
        self.current = max_threads
        self._set = set_threads
        self._applied = (
            applied  # the count in force now, where others may set it too (several engines, one thread)
        )
        self._active: int | None = None
        self._min_period, self._max_period, self._period = period, max_period, period
        self._probe_steps, self._margin, self._slowdown = probe_steps, margin, slowdown
        self._abandon = abandon  # a probed count whose first step takes this many times the current's is dropped
        self._since_probe = 0
        self._plan: list[int] = []  # thread counts of the probe steps still to run
        self._probe_key: int | None = None
        self._probed: dict[int, list[float]] = {}
        self._recent: dict[int, deque[float]] = {}  # key -> step times at the current count
        self._best: dict[tuple[int, int], float] = {}  # (threads, key) -> best median seen
        self.switches = 0

    def threads_for(self, key: int | None) -> int:
        """The thread count for the next step (applied); a probe's count when one is under way for this key."""
        probing = bool(self._plan) and key is not None and key == self._probe_key
        n = self._plan[0] if probing else self.current
        if n != (self._applied() if self._applied is not None else self._active):
            self._set(n)
            self._active = n
        return n

    def record(self, key: int | None, threads: int, seconds: float) -> None:
        """Learn from a step run on `threads` (what `threads_for` returned) that took `seconds`."""
        if key is None:
            return
        if self._plan and key == self._probe_key and threads == self._plan[0]:
            self._plan.pop(0)
            self._probed.setdefault(threads, []).append(seconds)
            current = self._recent.get(key)
            if current and seconds > self._abandon * statistics.median(current):
                # clearly slower: its other probe steps would only cost time (on a quiet CPU, every probe)
                self._plan = [n for n in self._plan if n != threads]
            if not self._plan:
                self._decide(key)
            return
        if threads != self.current:
            return
        recent = self._recent.setdefault(key, deque(maxlen=2 * self._probe_steps + 2))
        recent.append(seconds)
        self._since_probe += 1
        if self._plan or len(recent) < recent.maxlen:
            return
        now = statistics.median(recent)
        best = self._best.get((threads, key))
        self._best[(threads, key)] = now if best is None else min(best, now)
        slower = best is not None and now > self._slowdown * best
        if self._since_probe >= self._period or (slower and self._since_probe >= self._min_period):
            self._plan = [n for n in self.candidates if n != self.current for _ in range(self._probe_steps)]
            self._probe_key, self._probed = key, {}
            if not self._plan:  # a single candidate: nothing to compare
                self._since_probe = 0

    def _decide(self, key: int) -> None:
        now = statistics.median(self._recent[key])
        times = {n: statistics.median(t) for n, t in self._probed.items()}
        best = min(times, key=times.__getitem__)
        self._since_probe = 0
        if times[best] < (1 - self._margin) * now:
            log.info(
                "decode steps take %.1f ms on %d thread(s) and %.1f ms on %d: using %d (%s)",
                now * 1e3,
                self.current,
                times[best] * 1e3,
                best,
                best,
                "the CPU is shared" if best < self.current else "the CPU is free again",
            )
            self.current = best
            self.switches += 1
            self._period = self._min_period
            self._recent.clear()
        else:
            self._period = min(2 * self._period, self._max_period)
