"""Schemathesis against our own /openapi.json: every operation, generated valid and invalid requests; no 5xx, and
every response conforms to the status codes, content types, headers and schemas the document declares."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import pytest
import schemathesis
from conftest import MODEL, Server
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance, response_schema_conformance

OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/v1/tcp_warming"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
MAX_TOKENS = 2  # generation is bounded so a few hundred cases take seconds, not hours


KEY = "schemathesis-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_server():
    """A server that requires a key, so the document's security requirements are exercised too."""
    s = Server("--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(keyed_server):
    schema = schemathesis.openapi.from_url(keyed_server.url + "/openapi.json")
    # schemathesis reads 20 events of a stream by default and cuts it there: n choices of a few tokens each, plus
    # [DONE], pass that, and a cut stream has no [DONE] for _check_events to find
    schema.config.max_stream_events = 10_000
    return schema


def test_the_document_lists_exactly_these_operations(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


_TURN = itertools.count()


def _adjust(case, mode) -> None:
    """Bound generation, and aim most valid bodies at the served model (a random name is a 404, which says little)."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            mt = body.get(key)
            if key in body or key == "max_tokens":
                if type(mt) is not int or mt < 0 or mt > MAX_TOKENS:
                    body[key] = MAX_TOKENS  # null or -1 would generate to the end of the context
        if mode == GenerationMode.POSITIVE and isinstance(body.get("model"), str) and next(_TURN) % 4:
            body["model"] = MODEL  # three cases in four; the fourth keeps its generated name
    params = case.path_parameters
    if mode == GenerationMode.POSITIVE and params and next(_TURN) % 2:
        params["model_id"] = MODEL
    if case.headers and case.headers.get("X-delay-time") == "null":
        del case.headers["X-delay-time"]  # a JSON null has no header form; schemathesis writes the word


# /health and /v1/tcp_warming take no parameters, body or key: nothing in a request to them can violate the schema.
RUNS = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode == GenerationMode.POSITIVE or path not in ("/health", "/v1/tcp_warming")
]


@pytest.mark.parametrize("method,path,mode", RUNS)
def test_generated_requests_get_conforming_answers(api_schema, keyed_server, method, path, mode):
    operation = api_schema[path][method]
    statuses = []
    # each run draws new examples (no database): the suite stays within its time, and runs add up over time
    examples = {"/v1/completions": 100, "/v1/chat/completions": 60}.get(path, 40)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        _adjust(case, mode)
        # A schema-valid body may still name an unknown model or overrun the context: a 4xx, not a defect.
        # an event stream is checked event by event below (the document gives each event's schema)
        streamed = isinstance(case.body, dict) and case.body.get("stream") is True
        excluded = [positive_data_acceptance] + ([response_schema_conformance] if streamed else [])
        r = case.call_and_validate(base_url=keyed_server.url, headers=AUTH, excluded_checks=excluded)
        if streamed and r.status_code == 200:
            _check_events(
                r.text,
                _document(keyed_server.url)["paths"][path]["post"]["responses"]["200"]["content"],
                _document(keyed_server.url),
            )
        statuses.append(r.status_code)

    check()
    print(path, mode, len(statuses), sorted(Counter(statuses).items()))


@functools.cache
def _document(url: str) -> dict:
    import httpx

    return httpx.get(url + "/openapi.json", timeout=30).json()


def _check_events(text: str, content: dict, document: dict) -> None:
    """Every `data:` event of a stream is [DONE] or a JSON object valid under the event-stream schema."""
    import json

    import jsonschema

    schema = {**content["text/event-stream"]["schema"], "components": document["components"]}
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-1:]
    for data in events[:-1]:
        jsonschema.validate(json.loads(data), schema)
