"""The engine's thread plan (OMP_NUM_THREADS unless the operator chose) and the governor that runs fewer threads
while the CPU is shared."""

from __future__ import annotations

import subprocess
import sys

import pytest

from waferscale.engine.thread_governor import ThreadGovernor
from waferscale.threads import available_cpus, plan_threads


def test_default_is_every_available_cpu():
    env: dict[str, str] = {}
    plan = plan_threads(None, env)
    assert env == {"OMP_NUM_THREADS": str(available_cpus())}
    assert (plan.threads, plan.cpus, plan.wait_policy) == (available_cpus(), available_cpus(), "default")


def test_threads_flag_wins_over_the_environment():
    env = {"OMP_NUM_THREADS": "7"}
    assert plan_threads(1, env).threads == 1 and env["OMP_NUM_THREADS"] == "1"


def test_operator_settings_are_kept():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "active"}
    plan = plan_threads(None, env)
    assert (plan.threads, plan.wait_policy) == (3, "active") and env["OMP_WAIT_POLICY"] == "active"


def test_describe_names_threads_cpus_and_policy():
    line = plan_threads(2, {}).describe()
    assert "2 thread(s)" in line and "CPU(s)" in line and "default" in line and "--threads" in line


@pytest.mark.parametrize("bad", [0, -1])
def test_threads_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="at least 1"):
        plan_threads(bad, {})


def test_cli_refuses_zero_threads_before_loading():
    done = subprocess.run(
        [sys.executable, "-m", "waferscale", "complete", "--threads", "0", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--threads must be at least 1" in done.stderr


class Machine:
    """Step times of a CPU: `cost[threads]` seconds a step (what a governor would measure)."""

    def __init__(self, cost: dict[int, float]):
        self.cost = cost
        self.applied: list[int] = []

    def run(self, gov: ThreadGovernor, steps: int, key: int | None = 1) -> list[int]:
        used = []
        for _ in range(steps):
            n = gov.threads_for(key)
            used.append(n)
            gov.record(key, n, self.cost[n])
        return used


QUIET = {4: 0.010, 2: 0.016, 1: 0.028}
SHARED = {4: 0.200, 2: 0.060, 1: 0.030}  # another process on a core: barriers wait, one thread has none


def test_governor_keeps_every_thread_on_a_quiet_cpu_probing_rarely():
    m = Machine(QUIET)
    gov = ThreadGovernor(4, m.applied.append)
    used = m.run(gov, 2000)
    assert gov.current == 4 and gov.switches == 0
    assert used.count(4) > 0.98 * len(used)  # probes back off while nothing is faster


def test_a_probed_count_clearly_slower_costs_one_step_not_three():
    m = Machine(QUIET)
    gov = ThreadGovernor(4, m.applied.append, probe_steps=3)
    used = m.run(gov, 2000)
    probes = sum(1 for a, b in zip(used, used[1:]) if a == 4 and b != 4)
    assert probes >= 3 and used.count(2) == probes and used.count(1) == probes


def test_governor_drops_threads_when_the_cpu_is_shared_and_comes_back():
    m = Machine(QUIET)
    gov = ThreadGovernor(4, m.applied.append)
    m.run(gov, 300)
    m.cost = SHARED
    used = m.run(gov, 200)
    assert gov.current == 1 and used[-100:].count(1) > 90  # within a probe period (64 steps here)
    m.cost = QUIET
    m.run(gov, 1200)
    assert gov.current == 4 and gov.switches == 2


def test_governor_applies_counts_only_when_they_change():
    m = Machine(QUIET)
    gov = ThreadGovernor(2, m.applied.append)
    m.run(gov, 50)
    assert m.applied == [2]


def test_prefill_steps_are_not_measured_nor_probed():
    m = Machine(SHARED)
    gov = ThreadGovernor(4, m.applied.append)
    assert set(m.run(gov, 500, key=None)) == {4} and gov.switches == 0


def test_one_thread_has_nothing_to_probe():
    m = Machine({1: 0.01})
    gov = ThreadGovernor(1, m.applied.append)
    assert set(m.run(gov, 300)) == {1}
