"""The pure parts of `serve --replicas`: the autoscaling decision and the CPU check of a layout."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from waferscale.api.models_registry import ModelSpec
from waferscale.engine.settings import EngineSettings
from waferscale.scale.autoscale import decide
from waferscale.scale.launch import _deployment_names, layout


def test_scales_up_on_calls_in_flight_queue_depth_or_kv_use():
    assert decide(1, ongoing=4, waiting=0, kv=0.1, target=8) == 1
    assert decide(1, ongoing=20, waiting=0, kv=0.1, target=8) == 3  # as many as the calls need
    assert decide(2, ongoing=4, waiting=3, kv=0.1, target=8) == 3  # sequences queue in an engine
    assert decide(2, ongoing=4, waiting=0, kv=0.9, target=8) == 3  # KV cache nearly full: preemption ahead


def test_scales_down_one_at_a_time_only_when_the_rest_would_be_half_busy():
    assert decide(3, ongoing=0, waiting=0, kv=0.0, target=8) == 2
    assert decide(2, ongoing=4, waiting=0, kv=0.1, target=8) == 1
    assert decide(2, ongoing=5, waiting=0, kv=0.1, target=8) == 2
    assert decide(2, ongoing=0, waiting=0, kv=0.6, target=8) == 2  # prefixes in use on both: keep them
    assert decide(1, ongoing=0, waiting=0, kv=0.0, target=8) == 1


def args(**kw) -> argparse.Namespace:
    base = dict(replicas="2", min_replicas=1, max_replicas=2, replica_threads=None)
    return argparse.Namespace(**(base | kw))


def test_layout_splits_the_cluster_cpus_between_replicas():
    assert layout(args(), 8) == (2, 2, 4)
    assert layout(args(replicas="auto", max_replicas=4), 8) == (1, 4, 2)
    assert layout(args(replicas="1", replica_threads=2), 2) == (1, 1, 2)


def test_a_layout_needing_more_cpus_than_the_cluster_is_refused(capsys):
    with pytest.raises(SystemExit):
        layout(args(replicas="3", replica_threads=1), 2)
    message = capsys.readouterr().err
    assert "3 replica(s) x 1 thread(s) need 3 CPUs but the Ray cluster has 2" in message
    with pytest.raises(SystemExit):
        layout(args(replicas="auto", min_replicas=1, max_replicas=4, replica_threads=1), 2)
    with pytest.raises(SystemExit):
        layout(args(replicas="two"), 2)


def test_each_model_of_several_gets_its_own_replicas_cpus():
    assert layout(args(replicas="1"), 8, models=2) == (1, 1, 4)
    assert layout(args(replicas="2"), 8, models=2) == (2, 2, 2)


def test_several_models_needing_more_cpus_than_the_cluster_are_refused(capsys):
    with pytest.raises(SystemExit):
        layout(args(replicas="2", replica_threads=1), 2, models=2)
    assert "2 models x 2 replica(s) x 1 thread(s) need 4 CPUs but the Ray cluster has 2" in capsys.readouterr().err


def test_each_model_is_its_own_deployment_named_after_it():
    specs = [ModelSpec(name, EngineSettings()) for name in ("small", "org/model:8b", "org_model_8b")]
    assert _deployment_names(specs) == ["engine-small", "engine-org_model_8b", "engine-org_model_8b-3"]


def _serve(*argv: str, tmp_path) -> subprocess.CompletedProcess:
    """`waferscale serve ARGV` up to where it exits (refused before Ray or a model is loaded)."""
    return subprocess.run([sys.executable, "-m", "waferscale", "serve", *argv], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip


def test_replicas_refuse_a_memory_budget_with_several_models(tmp_path):
    out = _serve("--model", "smollm2-135m-instruct", "--model", "gemma-3-270m", "--replicas", "1",
                 "--memory-budget", "1GiB", tmp_path=tmp_path)  # fmt: skip
    assert out.returncode == 2
    assert "--memory-budget loads models on demand in one process" in out.stderr


def test_replicas_refuse_a_model_that_cannot_be_found_at_start(tmp_path):
    (tmp_path / "models.toml").write_text('[[model]]\nname = "a"\npath = "smollm2-135m-instruct"\n'
                                          '[[model]]\nname = "b"\npath = "missing.gguf"\n')  # fmt: skip
    out = _serve("--models", "models.toml", "--replicas", "1", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("waferscale: error: model 'b': ") and "missing.gguf" in out.stderr


def test_the_single_process_server_never_imports_ray():
    code = (
        "import sys, waferscale.cli, waferscale.api.server, waferscale.scale.launch, waferscale.scale.routing; "
        "waferscale.cli.build_parser().parse_args(['serve']); print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
