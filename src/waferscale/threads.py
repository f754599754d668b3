"""How many CPU threads the engine decodes on: OMP_NUM_THREADS, set before PyTorch is imported (which reads it).

`--threads N` gives the engine N threads (fewer than the CPUs leaves the rest to other processes); without it, the
operator's OMP_NUM_THREADS, else every CPU this process may run on. Within that count the engine's ThreadGovernor
(engine/thread_governor.py) runs fewer threads while another process takes a core. libgomp's wait policy is left
as the operator sets it: its default (spin, then sleep) is the fastest on a CPU of the engine's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPlan:
    """The engine's most threads, the CPUs this process may run on, and libgomp's wait policy (as set)."""

    threads: int
    cpus: int
    wait_policy: str

    def describe(self) -> str:
        """One log line's worth: what the engine uses, and why an operator might change it."""
        return (
            f"decoding on up to {self.threads} thread(s) of {self.cpus} CPU(s), fewer while other processes "
            f"take cores; OpenMP wait policy: {self.wait_policy} (--threads N leaves CPUs to other processes)"
        )


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_threads(threads: int | None, environ: dict[str, str] | None = None) -> ThreadPlan:
    """Set OMP_NUM_THREADS in `environ` (os.environ by default) for `threads` (None: the operator's
    OMP_NUM_THREADS, else every available CPU); call before PyTorch is imported, which reads it."""
    env = os.environ if environ is None else environ
    cpus = available_cpus()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, not {threads}")
        env["OMP_NUM_THREADS"] = str(threads)
    elif not env.get("OMP_NUM_THREADS", "").isdigit() or int(env["OMP_NUM_THREADS"]) < 1:
        env["OMP_NUM_THREADS"] = str(cpus)
    return ThreadPlan(int(env["OMP_NUM_THREADS"]), cpus, env.get("OMP_WAIT_POLICY", "default").lower())
