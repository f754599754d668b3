"""Usage per key in /metrics and the `waferscale usage` table read back from it, without a server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from waferscale.api.auth import KeyUsage
from waferscale.api.metrics import UsageCollector
from waferscale.usage import format_table, parse_usage


def metrics_text(usage: dict[str, KeyUsage]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(UsageCollector(lambda: usage))
    return generate_latest(registry).decode()


def test_usage_is_labelled_by_key_name():
    text = metrics_text({"alice": KeyUsage(requests=2, prompt_tokens=30, cached_tokens=16, completion_tokens=9)})
    assert 'waferscale_key_requests_total{key="alice"} 2.0' in text
    assert 'waferscale_key_cached_tokens_total{key="alice"} 16.0' in text
    assert 'waferscale_key_rate_limited_total{key="alice"} 0.0' in text


def test_the_usage_command_reads_back_what_metrics_wrote():
    usage = {
        "alice": KeyUsage(requests=2, prompt_tokens=30, cached_tokens=16, completion_tokens=9, rate_limited=1),
        "bob": KeyUsage(requests=1, prompt_tokens=5, completion_tokens=4),
    }
    rows = parse_usage(metrics_text(usage) + "waferscale_generated_tokens_total 13.0\n")
    assert rows == {
        "alice": {"requests": 2, "rate_limited": 1, "prompt_tokens": 30, "cached_tokens": 16, "completion_tokens": 9},
        "bob": {"requests": 1, "rate_limited": 0, "prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 4},
    }


def test_the_table_has_a_line_per_key_and_a_total():
    rows = {
        "bob": {"requests": 1, "rate_limited": 0, "prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 4},
        "alice": {"requests": 2, "rate_limited": 1, "prompt_tokens": 30, "cached_tokens": 16, "completion_tokens": 9},
    }
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["key", "requests", "429s", "prompt", "cached", "completion"]
    assert [line.split() for line in lines[1:]] == [
        ["alice", "2", "1", "30", "16", "9"],
        ["bob", "1", "0", "5", "0", "4"],
        ["total", "3", "1", "35", "16", "13"],
    ]
