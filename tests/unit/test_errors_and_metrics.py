"""Error kinds become statuses only in api/errors.py; /metrics text is rendered by prometheus_client from a snapshot."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from waferscale.api.errors import engine_error
from waferscale.api.metrics import make_registry, render
from waferscale.engine.errors import ErrorKind, RequestError
from waferscale.engine.metrics import EngineStats, Histogram

ENGINE = Path(__file__).resolve().parents[2] / "src" / "waferscale" / "engine"


def test_each_kind_has_its_status_and_a_client_mistake_is_never_a_500():
    statuses = {kind: engine_error(RequestError(kind, "m")).status_code for kind in ErrorKind}
    assert statuses == {
        ErrorKind.INVALID_REQUEST: 400,
        ErrorKind.OVERLOADED: 503,
        ErrorKind.SHUTTING_DOWN: 503,
        ErrorKind.UNAVAILABLE: 503,
        ErrorKind.INTERNAL: 500,
    }
    err = engine_error(RequestError(ErrorKind.INVALID_REQUEST, "too long", "prompt"))
    assert err.body()["error"] == {
        "message": "too long",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "",  # the contract's ErrorChunkContent default for what does not apply
        "id": "",
    }


def test_the_engine_holds_no_http_statuses_and_no_prometheus_text():
    for path in ENGINE.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\b(status|error_status)\s*[=:]\s*\d{3}\b", text), path.name
        assert "# HELP" not in text and "# TYPE" not in text and "_bucket{" not in text, path.name
        assert "fastapi" not in text and "starlette" not in text, path.name


def test_metrics_render_the_snapshot_with_help_text_and_process_figures():
    ttft = Histogram()
    for v in (0.003, 0.2, 7.0):
        ttft.observe(v)
    stats = EngineStats(running=2, waiting=1, generated_tokens=42, prefix_cache_hits=3, ttft=ttft.snapshot())
    text = render(make_registry(lambda: stats, lambda: {"rejected_requests": 5})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["waferscale_running"].type == "gauge" and families["waferscale_running"].samples[0].value == 2
    assert families["waferscale_generated_tokens"].type == "counter"
    assert "waferscale_generated_tokens_total 42.0" in text and "waferscale_rejected_requests_total 5.0" in text
    assert all(f.documentation for name, f in families.items() if name.startswith("waferscale_"))
    hist = {s.labels.get("le"): s.value for s in families["waferscale_time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert hist["0.005"] == 1 and hist["0.25"] == 2 and hist["+Inf"] == 3
    assert "waferscale_time_to_first_token_seconds_count 3.0" in text
    assert "process_resident_memory_bytes" in text and "process_cpu_seconds_total" in text
