"""Our /openapi.json describes POST /v1/completions and POST /v1/chat/completions as their contracts
(tests/contract/*.openapi.json, vendored) do, and is valid OpenAPI 3.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONTRACTS = Path(__file__).resolve().parent / "contract"  # vendored, see its README
SPEC_PATH = CONTRACTS / "completions.openapi.json"
CHAT_SPEC_PATH = CONTRACTS / "chat-completions.openapi.json"
KEYWORDS = ("type", "minimum", "maximum", "maxLength", "minLength", "maxItems", "minItems", "const", "enum")

# Differences we mean, each with its reason: {(schema, property): reason}.
INTENDED = {
    ("CompletionLogProbs", "token_logprobs"): "echo with logprobs: the first prompt token's logprob is null",
    (
        "CompletionLogProbs",
        "top_logprobs",
    ): "echo with logprobs: the first prompt token has no alternatives (null)",
}


@pytest.fixture(scope="module")
def spec():
    if not SPEC_PATH.is_file():
        pytest.fail(f"the reference contract is missing at {SPEC_PATH}")
    return json.loads(SPEC_PATH.read_text())


@pytest.fixture(scope="module")
def ours(server):
    import httpx

    return httpx.get(server.url + "/openapi.json").json()


def shape(node, root):
    """A comparable digest of a schema: types, ranges, refs, item shapes (titles and descriptions ignored)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return ("ref", node["$ref"].rsplit("/", 1)[-1])
        out = {k: node[k] for k in KEYWORDS if k in node}
        if (
            "allOf" in node and len(node["allOf"]) == 1
        ):  # {"allOf": [X]} is X with siblings (as pydantic writes it)
            return shape({**{k: v for k, v in node.items() if k != "allOf"}, **node["allOf"][0]}, root)
        if "anyOf" in node:
            out["anyOf"] = sorted((shape(x, root) for x in node["anyOf"]), key=repr)
        if "items" in node:
            out["items"] = shape(node["items"], root)
        if "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
            out["additionalProperties"] = shape(node["additionalProperties"], root)
        return tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in out.items()))
    return node


def assert_schemas_match(spec: dict, ours: dict, skip: set[str] = frozenset()) -> None:
    """Every schema of `spec` is in `ours` with the same properties, required list, closedness, enum, union shape,
    and per property the same shape, default and deprecation (names in `skip`: the same properties only)."""
    theirs, mine = spec["components"]["schemas"], ours["components"]["schemas"]
    for name, schema in theirs.items():
        assert name in mine, f"schema {name} missing from our document"
        m = mine[name]
        assert set(schema.get("properties", {})) == set(m.get("properties", {})), name
        if name in skip:
            continue
        assert sorted(schema.get("required", [])) == sorted(m.get("required", [])), name
        assert schema.get("additionalProperties") == m.get("additionalProperties"), name
        if "enum" in schema:
            assert schema["enum"] == m["enum"], name
        if "anyOf" in schema:
            assert shape(schema, spec) == shape(m, ours), name
        for prop, p in schema.get("properties", {}).items():
            if (name, prop) in INTENDED:
                continue
            q = m["properties"][prop]
            assert shape(p, spec) == shape(q, ours), f"{name}.{prop}"
            assert p.get("default", "<none>") == q.get("default", "<none>"), f"default of {name}.{prop}"
            assert p.get("deprecated", False) == q.get("deprecated", False), f"deprecated {name}.{prop}"


def test_every_spec_schema_exists_with_the_same_properties(spec, ours):
    assert_schemas_match(spec, ours)


def test_intended_differences_are_still_differences(spec, ours):
    """Each listed difference must exist; drop it from INTENDED when it no longer does."""
    theirs, mine = spec["components"]["schemas"], ours["components"]["schemas"]
    for (name, prop), _reason in INTENDED.items():
        assert shape(theirs[name]["properties"][prop], spec) != shape(mine[name]["properties"][prop], ours)


def test_completions_operation_matches(spec, ours):
    theirs = spec["paths"]["/v1/completions"]["post"]
    mine = ours["paths"]["/v1/completions"]["post"]
    assert theirs["operationId"] == mine["operationId"]
    assert set(theirs["requestBody"]["content"]) == set(mine["requestBody"]["content"])
    for ct, body in mine["requestBody"]["content"].items():
        assert body["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}, ct
    assert mine["requestBody"]["required"] is True
    for code in ("200", "422"):
        t = theirs["responses"][code]["content"]["application/json"]["schema"]
        m = mine["responses"][code]["content"]["application/json"]["schema"]
        assert t == m, code
    headers = {(p["name"], p["in"]): shape(p["schema"], spec) for p in theirs["parameters"]}
    our_headers = {(p["name"], p["in"]): shape(p["schema"], ours) for p in mine["parameters"]}
    assert headers == our_headers
    assert mine["security"] == theirs["security"]
    assert "BearerAuth" in ours["components"]["securitySchemes"]


# Names both contracts use for response parts, with different shapes: one document can hold one of each, so ours
# keeps the completions contract's (closed, non-null counts), which a chat client accepts too.
SHARED_WITH_COMPLETIONS = {
    "TimeInfo",
    "Usage",
    "PromptTokensDetails",
    "CompletionTokensDetails",
    "ErrorChunkContent",
    "ErrorChunkResponse",
}


@pytest.fixture(scope="module")
def chat_spec():
    return json.loads(CHAT_SPEC_PATH.read_text())


def test_every_chat_schema_exists_with_the_same_properties(chat_spec, ours):
    assert_schemas_match(chat_spec, ours, skip=SHARED_WITH_COMPLETIONS)


def test_shared_names_really_differ_between_the_contracts(spec, chat_spec):
    """Drop a name from SHARED_WITH_COMPLETIONS when the two contracts come to agree on it."""
    for name in SHARED_WITH_COMPLETIONS:
        a, b = spec["components"]["schemas"][name], chat_spec["components"]["schemas"][name]
        assert shape(a, spec) != shape(b, chat_spec) or a.get("additionalProperties") != b.get(
            "additionalProperties"
        ), name


def test_chat_operation_matches(chat_spec, ours):
    theirs = chat_spec["paths"]["/v1/chat/completions"]["post"]
    mine = ours["paths"]["/v1/chat/completions"]["post"]
    assert theirs["operationId"] == mine["operationId"]
    assert set(theirs["requestBody"]["content"]) == set(mine["requestBody"]["content"])
    for ct, body in mine["requestBody"]["content"].items():
        assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}, ct
    assert mine["requestBody"]["required"] is True
    for code, response in theirs["responses"].items():
        if code in ("402", "403"):  # no payments or permissions here
            continue
        for ct, content in response["content"].items():
            assert mine["responses"][code]["content"][ct]["schema"] == content["schema"], (code, ct)
    headers = {(p["name"], p["in"]): shape(p["schema"], chat_spec) for p in theirs["parameters"]}
    our_headers = {(p["name"], p["in"]): shape(p["schema"], ours) for p in mine["parameters"]}
    assert headers == our_headers
    assert mine["security"] == theirs["security"]


def test_document_is_valid_openapi_31_under_the_contract_title(ours, chat_spec):
    from openapi_spec_validator import validate

    validate(ours)
    assert ours["openapi"].startswith("3.1")
    assert ours["info"]["title"] == chat_spec["info"]["title"]
