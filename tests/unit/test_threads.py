"""The engine's thread plan: OMP_NUM_THREADS and a passive OpenMP wait policy unless the operator chose otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from waferscale.threads import available_cpus, plan_threads


def test_default_is_every_available_cpu_waiting_passively():
    env: dict[str, str] = {}
    plan = plan_threads(None, env)
    assert env == {"OMP_NUM_THREADS": str(available_cpus()), "OMP_WAIT_POLICY": "PASSIVE"}
    assert (plan.threads, plan.cpus, plan.wait_policy) == (available_cpus(), available_cpus(), "PASSIVE")


def test_threads_flag_wins_over_the_environment():
    env = {"OMP_NUM_THREADS": "7"}
    assert plan_threads(1, env).threads == 1 and env["OMP_NUM_THREADS"] == "1"


def test_operator_settings_are_kept():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "active"}
    plan = plan_threads(None, env)
    assert (plan.threads, plan.wait_policy) == (3, "ACTIVE") and env["OMP_WAIT_POLICY"] == "active"


def test_describe_names_threads_cpus_and_policy():
    line = plan_threads(2, {}).describe()
    assert "2 thread(s)" in line and "CPU(s)" in line and "passive" in line and "--threads" in line


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
