"""JSON schemas for constrained decoding: the strict-mode checks, the `%json` rules llguidance compiles, and the
grammar of a `response_format`.

Whitespace is bounded everywhere (one space, or one or two newlines and up to 20 spaces/tabs of indent), as in
engine/grammar.py, so a sampled document cannot drift into endless blank lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from waferscale.api.errors import APIError

MAX_ANY_OF = 5
MAX_SCHEMA_DEPTH = 64

# JSON Schema keywords that only annotate: accepted in strict schemas and dropped before compiling (so are "x-" keys).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "example",
        "$comment",
        "$schema",
        "$id",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
    }
)
# String formats llguidance enforces; strict schemas may use them (others are rejected, not silently ignored).
FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_NODE_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
# OpenAPI's tag beside a union (Pydantic writes it for discriminated unions); llguidance reads it to prove the
# branches of a oneOf exclusive.
_UNION_ANNOTATIONS = frozenset({"discriminator"})
_NUMERIC_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
# Keywords that constrain one type, all enforced by llguidance while decoding.
_TYPE_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "string": frozenset({"format", "pattern", "minLength", "maxLength"}),
    "number": _NUMERIC_KEYWORDS,
    "integer": _NUMERIC_KEYWORDS,
}
_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"})
_SUPPORTED = (
    "type, enum, const, anyOf, oneOf (branches that exclude each other), allOf (one schema), $ref/$defs; "
    "objects: properties, required, additionalProperties: false, minProperties, maxProperties; arrays: items, prefixItems, minItems, maxItems; "
    "strings: format, pattern, minLength, maxLength; numbers: minimum, maximum, exclusiveMinimum, "
    "exclusiveMaximum, multipleOf; annotations such as description"
)
_HINTS = {
    "definitions": "'definitions' is not supported in JSON schema. Use '$defs' instead",
    "nullable": '\'nullable\' is not supported in JSON schema; use anyOf with {"type": "null"}',
}

# Whitespace a JSON document may hold at each place JSON allows it (llguidance: matched at most once per place).
JSON_WS = r"(?: |\n[ \t]{0,20})"
_X_GUIDANCE = {"whitespace_pattern": JSON_WS}
# Lark rules shared by every grammar of the package.
COMMON_RULES = r"""
WS: / |\n{1,2}[ \t]{0,20}/
"""
ANY_OBJECT: dict = {"type": "object"}


def validate_strict_schema(schema: dict, param: str) -> None:
    """Raise APIError(400) unless `schema` keeps to what strict mode supports (reference §5) and can enforce.

    The hosted service's rules: type is one of string, number, integer, boolean, object, array, null (no lists);
    anyOf has 1..5 branches; $ref points to "#" or "#/$defs/<name>", $defs at the root; objects list every property
    in `required` and set `additionalProperties: false`; arrays give `items` (a schema, or false). Beyond them, every
    keyword llguidance enforces while decoding is accepted (string length, pattern, format, numeric bounds and
    multipleOf, array and object sizes, prefixItems, a one-schema allOf, a oneOf whose branches llguidance proves
    exclusive, as a discriminated union's are); annotations (title, description, default,
    examples, "x-" extensions, ...) are accepted and ignored. Anything else is refused, naming the keyword.
    """
    if not isinstance(schema, dict):
        raise APIError(400, "The JSON schema must be an object.", param=param)
    defs = schema.get("$defs")
    if defs is not None and not isinstance(defs, dict):
        raise APIError(400, "'$defs' must be an object mapping names to schemas.", param=f"{param}.$defs")
    _check_node(schema, param, defs or {}, root=True, depth=0)
    for name, sub in (defs or {}).items():
        _check_node(sub, f"{param}.$defs.{name}", defs, root=False, depth=1)


def _is_annotation(key: str) -> bool:
    return key in ANNOTATIONS or key.startswith("x-")


def _check_node(node: Any, path: str, defs: dict, *, root: bool, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise APIError(
            400, f"The JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep.", param=path
        )
    if isinstance(node, bool):
        raise APIError(
            400,
            f"Boolean schemas ({str(node).lower()}) are not supported in strict mode; write a schema object.",
            param=path,
        )
    if not isinstance(node, dict):
        raise APIError(400, "Each JSON schema must be an object.", param=path)
    for key in node:
        if key in _HINTS:
            raise APIError(400, _HINTS[key], param=f"{path}.{key}")
    if "type" in node and isinstance(node["type"], list):
        raise APIError(
            400,
            "Lists of types are not supported in JSON schema; use anyOf with one schema per type, e.g. "
            '{"anyOf": [{"type": "string"}, {"type": "null"}]}.',
            param=f"{path}.type",
        )
    kind = node.get("type")
    if kind is not None and kind not in TYPES:
        raise APIError(
            400,
            f"Unsupported type {kind!r} in JSON schema; use one of {', '.join(TYPES)}.",
            param=f"{path}.type",
        )
    allowed = _NODE_KEYWORDS | _TYPE_KEYWORDS.get(kind, frozenset()) | ({"$defs"} if root else set())
    if "anyOf" in node or "oneOf" in node:
        allowed |= _UNION_ANNOTATIONS
    for key in node:
        if key in allowed or _is_annotation(key):
            continue
        if key == "$defs":
            raise APIError(400, "'$defs' is only supported at the root of the schema.", param=f"{path}.$defs")
        owners = [t for t, kws in _TYPE_KEYWORDS.items() if key in kws]
        if owners:
            raise APIError(
                400,
                f"'{key}' is only allowed with " + " or ".join(f'"type": "{t}"' for t in owners) + ".",
                param=f"{path}.{key}",
            )
        raise APIError(
            400,
            f"'{key}' is not supported in strict JSON schema: constrained decoding cannot enforce it. "
            f"Supported: {_SUPPORTED}.",
            param=f"{path}.{key}",
        )
    if not _NODE_KEYWORDS & set(node):
        raise APIError(400, "Each schema needs 'type', 'enum', 'const', 'anyOf', 'oneOf' or '$ref'.", param=path)
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise APIError(400, "'enum' must be a non-empty list of values.", param=f"{path}.enum")
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or _def_name(ref) in defs):
            raise APIError(
                400,
                f"'$ref' {ref!r} does not name a schema; use '#/$defs/<name>' with <name> defined in '$defs'.",
                param=f"{path}.$ref",
            )
    for union in ("anyOf", "oneOf"):
        if union not in node:
            continue
        branches = node[union]
        if not isinstance(branches, list) or not 1 <= len(branches) <= MAX_ANY_OF:
            raise APIError(400, f"'{union}' must list 1 to {MAX_ANY_OF} schemas.", param=f"{path}.{union}")
        for i, sub in enumerate(branches):
            _check_node(sub, f"{path}.{union}[{i}]", defs, root=False, depth=depth + 1)
    if "allOf" in node:
        if not isinstance(node["allOf"], list) or len(node["allOf"]) != 1:
            raise APIError(
                400,
                "'allOf' is supported with one schema only (as Pydantic writes a $ref with annotations); write "
                "the combined schema out.",
                param=f"{path}.allOf",
            )
        _check_node(node["allOf"][0], f"{path}.allOf[0]", defs, root=False, depth=depth + 1)
    for key in sorted(_COUNTS & set(node)):
        value = node[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise APIError(400, f"'{key}' must be a non-negative integer.", param=f"{path}.{key}")
    for key in sorted(_NUMERIC_KEYWORDS & set(node)):
        value = node[key]
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or (key == "multipleOf" and value <= 0)
        ):
            positive = " greater than 0" if key == "multipleOf" else ""
            raise APIError(400, f"'{key}' must be a number{positive}.", param=f"{path}.{key}")
    if kind == "object":
        _check_object(node, path, defs, depth)
    elif kind == "array":
        _check_array(node, path, defs, depth)
    elif kind == "string":
        _check_string(node, path)


def _check_array(node: dict, path: str, defs: dict, depth: int) -> None:
    prefix = node.get("prefixItems")
    if prefix is not None:
        if not isinstance(prefix, list) or not prefix:
            raise APIError(
                400, "'prefixItems' must be a non-empty list of schemas.", param=f"{path}.prefixItems"
            )
        for i, sub in enumerate(prefix):
            _check_node(sub, f"{path}.prefixItems[{i}]", defs, root=False, depth=depth + 1)
    closed = prefix is not None and node.get("maxItems", len(prefix) + 1) <= len(prefix)  # no items past them
    if "items" not in node and closed:
        return
    if "items" not in node or node["items"] is True:
        raise APIError(
            400,
            "'items: true' (or no 'items') is not supported for arrays; give the schema of the items"
            + (" after 'prefixItems' (or false)." if prefix is not None else "."),
            param=f"{path}.items",
        )
    if node["items"] is not False:
        _check_node(node["items"], f"{path}.items", defs, root=False, depth=depth + 1)


def _check_string(node: dict, path: str) -> None:
    if "format" in node and node["format"] not in FORMATS:
        raise APIError(
            400,
            f"'format' {node['format']!r} is not supported; use one of {', '.join(sorted(FORMATS))}.",
            param=f"{path}.format",
        )
    if "pattern" in node:
        pattern = node["pattern"]
        if not isinstance(pattern, str):
            raise APIError(
                400, "'pattern' must be a regular expression in a string.", param=f"{path}.pattern"
            )
        err = llguidance.LLMatcher.validate_grammar(
            f"start: x\nx: {json_rule({'type': 'string', 'pattern': pattern})}\n"
        )
        if err:  # "...regex parse error:\n    <pattern>\n    ^^^\nerror: look-around, ... is not supported"
            lines = [ln.strip() for ln in err.splitlines()]
            reason = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error:")), lines[0])
            raise APIError(
                400,
                f"'pattern' {pattern!r} cannot be used for constrained decoding: {reason}.",
                param=f"{path}.pattern",
            )


def _check_object(node: dict, path: str, defs: dict, depth: int) -> None:
    props = node.get("properties", {})
    if not isinstance(props, dict):
        raise APIError(400, "'properties' must be an object.", param=f"{path}.properties")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(400, "'required' must be a list of property names.", param=f"{path}.required")
    for name in props:
        if name not in required:
            raise APIError(
                400,
                f"Property '{name}' must be listed in 'required': strict mode needs every property there; make an "
                'optional field nullable with anyOf [..., {"type": "null"}].',
                param=f"{path}.properties.{name}",
            )
    for name in required:
        if name not in props:
            raise APIError(
                400, f"'required' names '{name}', which is not in 'properties'.", param=f"{path}.required"
            )
    if node.get("additionalProperties", True) is not False:
        raise APIError(
            400,
            "'additionalProperties' must be set to false on every object in strict mode.",
            param=f"{path}.additionalProperties",
        )
    for name, sub in props.items():
        _check_node(sub, f"{path}.properties.{name}", defs, root=False, depth=depth + 1)


def _def_name(ref: str) -> str | None:
    if not ref.startswith("#/$defs/"):
        return None
    name = ref[len("#/$defs/") :]
    return None if "/" in name else name.replace("~1", "/").replace("~0", "~")


def _strip_annotations(node: Any) -> Any:
    """A copy of a (validated, strict) schema without annotation keywords: a smaller grammar, nothing lost."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if _is_annotation(key):
            continue
        if key in ("properties", "$defs"):
            value = {k: _strip_annotations(v) for k, v in value.items()}
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            value = [_strip_annotations(v) for v in value]
        elif key == "items":
            value = _strip_annotations(value)
        out[key] = value
    return out


def json_rule(schema: dict, *, lenient: bool = False) -> str:
    """`%json {...}` for a schema, with our bounded whitespace (and, if asked, unsupported keywords ignored)."""
    doc = dict(schema)
    doc["x-guidance"] = {**_X_GUIDANCE, **({"lenient": True} if lenient else {})}
    return "%json " + json.dumps(doc, ensure_ascii=True, separators=(",", ":"))


def _compile_error(lark: str) -> str | None:
    """llguidance's complaint about a grammar (compiled without a tokenizer), or None if it compiles."""
    err = llguidance.LLMatcher.validate_grammar(lark)
    if not err:
        return None
    # "at 2(4): failed to compile JSON schema: <reason>\n<grammar excerpt>" -> "<reason>"
    first = re.sub(r"^at \d+\(\d+\): ", "", err.strip().splitlines()[0])
    return first.removeprefix("failed to compile JSON schema: ")


def schema_rule(schema: Any, param: str, *, strict: bool, what: str) -> str:
    """The %json rule text for a user schema: strict ones validated and compiled (400 if llguidance refuses),
    others compiled leniently (keywords llguidance cannot enforce ignored), falling back to any JSON object."""
    if strict:
        validate_strict_schema(schema, param)
        rule = json_rule(_strip_annotations(schema))
        err = _compile_error(f"start: x\nx: {rule}\n")
        if err and "oneOf" in err:
            err = (
                "its 'oneOf' branches could overlap, so exactly-one cannot be enforced; give each branch a "
                "property with its own 'const' (a discriminator, as Pydantic's discriminated unions do) or use "
                "'anyOf'"
            )
        if err:
            raise APIError(
                400, f"The {what} schema cannot be used for constrained decoding: {err}", param=param
            )
        return rule
    if isinstance(schema, dict):
        rule = json_rule(schema, lenient=True)
        if not _compile_error(f"start: x\nx: {rule}\n"):
            return rule
    return json_rule(ANY_OBJECT)


def response_format_grammar(response_format: dict | None) -> str | None:
    """Lark text that constrains the output to `response_format`, or None for plain text.

    json_object -> any JSON object; json_schema with strict: true -> that schema (checked first, 400 if outside
    what strict mode supports); json_schema not strict -> what llguidance can enforce of the schema, the rest
    ignored (any JSON object if it cannot compile it at all, or without a schema). Bounded whitespace may precede it.
    """
    rule = format_rule(response_format)
    return None if rule is None else f"start: WS? value\nvalue: {rule}\n{COMMON_RULES}"


def format_rule(response_format: dict | None) -> str | None:
    """The %json rule for a response format, or None for text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise APIError(400, "'response_format' must be an object.", param="response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        rule = json_rule(ANY_OBJECT)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(
                400,
                "response_format of type 'json_schema' needs a 'json_schema' object.",
                param="response_format.json_schema",
            )
        schema = spec.get("schema")
        if schema is None:
            rule = json_rule(ANY_OBJECT)
        else:
            rule = schema_rule(
                schema,
                "response_format.json_schema.schema",
                strict=spec.get("strict") is True,
                what="response_format",
            )
    else:
        raise APIError(
            400,
            f"Unknown response_format type {kind!r}; use 'text', 'json_object' or 'json_schema'.",
            param="response_format.type",
        )
    return rule
