"""How many CPU threads the engine decodes on, and how its OpenMP threads wait: set before PyTorch is imported.

A decode step runs hundreds of small OpenMP parallel regions, each ending at a barrier. libgomp's default is to
spin at a barrier before it sleeps; on a CPU shared with another process that spinning thread holds a core the
thread it waits for needs (or shares a core with it), and every barrier waits a scheduler time slice: decoding
collapses (scripts/bench_json_mode.py --busy measures it). Waiting passively (OMP_WAIT_POLICY=PASSIVE) lets the
waiting thread give its core up at once, so decoding slows in proportion to the CPU it gets. An operator's own
OMP_WAIT_POLICY (ACTIVE on a machine that runs nothing else) and OMP_NUM_THREADS are kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPlan:
    """The engine's thread count, the CPUs this process may run on, and libgomp's wait policy."""

    threads: int
    cpus: int
    wait_policy: str

    def describe(self) -> str:
        """One log line's worth: what the engine uses, and why an operator might change it."""
        return (
            f"decoding on {self.threads} thread(s) of {self.cpus} CPU(s), OpenMP wait policy "
            f"{self.wait_policy.lower()} (--threads N leaves CPUs to other processes)"
        )


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_threads(threads: int | None, environ: dict[str, str] | None = None) -> ThreadPlan:
    """Set OMP_NUM_THREADS and OMP_WAIT_POLICY in `environ` (os.environ by default) for `threads` (None: the
    operator's OMP_NUM_THREADS, else every available CPU); call before PyTorch is imported, which reads them."""
    env = os.environ if environ is None else environ
    cpus = available_cpus()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, not {threads}")
        env["OMP_NUM_THREADS"] = str(threads)
    elif not env.get("OMP_NUM_THREADS", "").isdigit() or int(env["OMP_NUM_THREADS"]) < 1:
        env["OMP_NUM_THREADS"] = str(cpus)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return ThreadPlan(int(env["OMP_NUM_THREADS"]), cpus, env["OMP_WAIT_POLICY"].upper())
