"""Tools and structured outputs for /v1/chat/completions: request checks, Lark grammars for llguidance, parsing.

Pure functions, no model: the engine constrains a sequence with the Lark text these return (`SamplingParams.lark`),
and `parse_tool_calls` splits the generated text back into content and calls.

Call syntaxes (what the chat template renders for an assistant turn with calls, and what the grammar accepts):

- ``hermes`` (Qwen2.5/Qwen3/Hermes templates; our fallback for templates without tool support)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  parallel calls follow one another, separated by a newline. In ``auto`` mode a call may follow some text.
  When the tokenizer has ``<tool_call>``/``</tool_call>`` as tokens of their own, llguidance treats them as special
  tokens (it does so for every added token spelled ``<...>``), so the grammar names them as tokens
  (pass `special_tokens`, see `grammar_special_tokens`); otherwise they are spelled as text.
- ``llama3_json`` (Llama 3.1/3.2 templates): the whole turn is one JSON object
  ``{"name": "get_weather", "parameters": {"city": "Paris"}}``. One call per turn: the Llama templates refuse to
  render more than one call in history, so ``parallel_tool_calls`` does not add more.

Whitespace is bounded everywhere (one space, or one or two newlines and up to 20 spaces/tabs of indent), as in
engine/grammar.py, so a sampled document cannot drift into endless blank lines.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from typing import Any

import llguidance

from waferscale.api.errors import APIError

SYNTAXES = ("hermes", "llama3_json")
TOOL_CHOICES = ("none", "auto", "required")
MAX_ANY_OF = 5
MAX_SCHEMA_DEPTH = 64
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")

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
_NODE_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "allOf", "$ref"})
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
    "type, enum, const, anyOf, allOf (one schema), $ref/$defs; objects: properties, required, "
    "additionalProperties: false, minProperties, maxProperties; arrays: items, prefixItems, minItems, maxItems; "
    "strings: format, pattern, minLength, maxLength; numbers: minimum, maximum, exclusiveMinimum, "
    "exclusiveMaximum, multipleOf; annotations such as description"
)
_HINTS = {
    "definitions": "'definitions' is not supported in JSON schema. Use '$defs' instead",
    "oneOf": "'oneOf' is not supported in strict JSON schema; use 'anyOf' (at most 5 branches)",
    "nullable": '\'nullable\' is not supported in JSON schema; use anyOf with {"type": "null"}',
}

# Whitespace a JSON document may hold at each place JSON allows it (llguidance: matched at most once per place).
JSON_WS = r"(?: |\n[ \t]{0,20})"
_X_GUIDANCE = {"whitespace_pattern": JSON_WS}
# Lark rules shared by every grammar here.
_COMMON = r"""
WS: / |\n{1,2}[ \t]{0,20}/
"""
_ANY_OBJECT: dict = {"type": "object"}


# ---------------------------------------------------------------------------------------------------- schemas


def validate_strict_schema(schema: dict, param: str) -> None:
    """Raise APIError(400) unless `schema` keeps to what strict mode supports (reference §5) and can enforce.

    The hosted service's rules: type is one of string, number, integer, boolean, object, array, null (no lists);
    anyOf has 1..5 branches; $ref points to "#" or "#/$defs/<name>", $defs at the root; objects list every property
    in `required` and set `additionalProperties: false`; arrays give `items` (a schema, or false). Beyond them, every
    keyword llguidance enforces while decoding is accepted (string length, pattern, format, numeric bounds and
    multipleOf, array and object sizes, prefixItems, a one-schema allOf); annotations (title, description, default,
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
        raise APIError(400, "Each schema needs 'type', 'enum', 'const', 'anyOf' or '$ref'.", param=path)
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
    if "anyOf" in node:
        branches = node["anyOf"]
        if not isinstance(branches, list) or not 1 <= len(branches) <= MAX_ANY_OF:
            raise APIError(400, f"'anyOf' must list 1 to {MAX_ANY_OF} schemas.", param=f"{path}.anyOf")
        for i, sub in enumerate(branches):
            _check_node(sub, f"{path}.anyOf[{i}]", defs, root=False, depth=depth + 1)
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
        if not isinstance(value, int | float) or isinstance(value, bool) or (key == "multipleOf" and value <= 0):
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
            raise APIError(400, "'prefixItems' must be a non-empty list of schemas.", param=f"{path}.prefixItems")
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
            raise APIError(400, "'pattern' must be a regular expression in a string.", param=f"{path}.pattern")
        err = llguidance.LLMatcher.validate_grammar(
            f"start: x\nx: {_json_rule({'type': 'string', 'pattern': pattern})}\n"
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
        elif key in ("anyOf", "allOf", "prefixItems"):
            value = [_strip_annotations(v) for v in value]
        elif key == "items":
            value = _strip_annotations(value)
        out[key] = value
    return out


def _json_rule(schema: dict, *, lenient: bool = False) -> str:
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


def _schema_rule(schema: Any, param: str, *, strict: bool, what: str) -> str:
    """The %json rule text for a user schema: strict ones validated and compiled (400 if llguidance refuses),
    others compiled leniently (keywords llguidance cannot enforce ignored), falling back to any JSON object."""
    if strict:
        validate_strict_schema(schema, param)
        rule = _json_rule(_strip_annotations(schema))
        err = _compile_error(f"start: x\nx: {rule}\n")
        if err:
            raise APIError(
                400, f"The {what} schema cannot be used for constrained decoding: {err}", param=param
            )
        return rule
    if isinstance(schema, dict):
        rule = _json_rule(schema, lenient=True)
        if not _compile_error(f"start: x\nx: {rule}\n"):
            return rule
    return _json_rule(_ANY_OBJECT)


def response_format_grammar(response_format: dict | None) -> str | None:
    """Lark text that constrains the output to `response_format`, or None for plain text.

    json_object -> any JSON object; json_schema with strict: true -> that schema (checked first, 400 if outside
    what strict mode supports); json_schema not strict -> what llguidance can enforce of the schema, the rest
    ignored (any JSON object if it cannot compile it at all, or without a schema). Bounded whitespace may precede it.
    """
    rule = _format_rule(response_format)
    return None if rule is None else f"start: WS? value\nvalue: {rule}\n{_COMMON}"


def _format_rule(response_format: dict | None) -> str | None:
    """The %json rule for a response format, or None for text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise APIError(400, "'response_format' must be an object.", param="response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        rule = _json_rule(_ANY_OBJECT)
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
            rule = _json_rule(_ANY_OBJECT)
        else:
            rule = _schema_rule(
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


# ---------------------------------------------------------------------------------------------------- tools


def grammar_special_tokens(tokenizer) -> frozenset[str]:
    """The added tokens llguidance treats as special for a `tokenizers.Tokenizer` (those marked special, and every
    added token spelled ``<...>``): pass it to `tool_grammar` so it names ``<tool_call>`` as a token when it is one.
    """
    return frozenset(
        t.content
        for t in tokenizer.get_added_tokens_decoder().values()
        if t.special or (t.content.startswith("<") and t.content.endswith(">"))
    )


def _check_tools(tools: Any) -> list[tuple[int, str, dict]]:
    """[(index in tools, name, function)] after checking shape, names (charset, length) and duplicates."""
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of tools.", param="tools")
    seen: dict[str, int] = {}
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, "Only tools of type 'function' are supported.", param=f"tools[{i}].type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, "A tool needs a 'function' object.", param=f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise APIError(
                400,
                "Function names must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'.",
                param=f"tools[{i}].function.name",
            )
        if name in seen:
            raise APIError(
                400,
                f"Duplicate tool name '{name}' (also tools[{seen[name]}]); tool names must be unique.",
                param=f"tools[{i}].function.name",
            )
        seen[name] = i
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(
                400, "'parameters' must be a JSON schema object.", param=f"tools[{i}].function.parameters"
            )
        out.append((i, name, fn))
    return out


def _choice(tool_choice: Any, names: Collection[str]) -> str:
    """'none' | 'auto' | 'required' | 'named:<name>' after checking the shape and the name."""
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise APIError(
                400,
                f"Unknown tool_choice {tool_choice!r}; use 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                param="tool_choice",
            )
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise APIError(
            400,
            'A named tool_choice is {"type": "function", "function": {"name": "<tool name>"}}.',
            param="tool_choice",
        )
    if name not in names:
        raise APIError(
            400,
            f"tool_choice names '{name}', which is not among the declared tools.",
            param="tool_choice.function.name",
        )
    return "named:" + name


def _lit(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text)


def tool_grammar(
    tools: list[dict] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    syntax: str,
    *,
    special_tokens: Collection[str] = (),
    response_format: dict | None = None,
) -> str | None:
    """Lark text for a tool-calling turn, or None when there are no tools.

    none -> text that never starts a call (tools stay in the prompt, so a model may try to call: the grammar makes
    sure it cannot); auto -> text, or calls (hermes: optionally after some text); required -> one or more calls
    (exactly one unless parallel); named -> exactly that function, once. A started call always completes validly;
    arguments follow each tool's `parameters` (strict tools: validated subset; others: leniently compiled, else
    any JSON object). The grammar ends after the last call.

    `special_tokens`: the tokens llguidance treats as special for the model's tokenizer (`grammar_special_tokens`).
    `response_format`: when it asks for JSON, the content alternative (none, auto) is that JSON instead of text;
    in auto mode, hermes then allows no text before a call.
    """
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {syntax!r}")
    if not tools:
        return None
    checked = _check_tools(tools)
    mode = _choice(tool_choice, [n for _, n, _ in checked])
    content = _format_rule(response_format)
    if mode.startswith("named:"):
        checked = [c for c in checked if c[1] == mode[6:]]
    key = "arguments" if syntax == "hermes" else "parameters"
    rules = []
    for i, (index, name, fn) in enumerate(checked):
        params = fn.get("parameters")
        param = f"tools[{index}].function.parameters"
        strict = fn.get("strict") is True
        if params is None:
            rule = _json_rule({"type": "object", "properties": {}, "additionalProperties": False})
        elif params.get("type", "object") != "object":
            if strict:
                raise APIError(
                    400, 'Function parameters must be a schema of "type": "object".', param=f"{param}.type"
                )
            rule = _json_rule(_ANY_OBJECT)
        else:
            # arguments are always an object: a non-strict schema that leaves out "type" gets it
            schema = params if strict else {**params, "type": "object"}
            rule = _schema_rule(schema, param, strict=strict, what="tool parameters")
        rules.append(
            f'body{i}: "{{" WS? "\\"name\\"" WS? ":" WS? {_lit(json.dumps(name))} WS? "," WS? '
            f'{_lit(json.dumps(key))} WS? ":" WS? args{i} WS? "}}"\nargs{i}: {rule}\n'
        )
    body = "body: " + " | ".join(f"body{i}" for i in range(len(checked))) + "\n" + "".join(rules)
    if syntax == "hermes":
        parallel = parallel_tool_calls and not mode.startswith("named:")  # a named choice calls it once
        start = _hermes_start(mode, parallel, special_tokens, content)
    else:
        start = _llama_start(mode, content)
    return start + body + _COMMON


def _hermes_start(mode: str, parallel: bool, special_tokens: Collection[str], content: str | None) -> str:
    special_open = "<tool_call>" in special_tokens
    open_ = "<tool_call>" if special_open else _lit("<tool_call>")
    close = "</tool_call>" if "</tool_call>" in special_tokens else _lit("</tool_call>")
    more = " (WS? call)*" if parallel else ""
    text = "TEXT_NOCALL: /(?s:.)*/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
    call = f"call: {open_} WS? body WS? {close}\n"
    if content is not None and mode in ("none", "auto"):
        calls = f" | WS? call{more}\n" + call if mode == "auto" else "\n"
        return f"start: WS? content{calls}content: {content}\n"
    if mode == "none":
        return "start: TEXT_NOCALL\n" + text
    if mode == "auto":
        if special_open:
            return f"start: TEXT_NOCALL | TEXT_NOCALL call{more}\n" + call + text
        # The text before a call ends lazily at the first "<tool_call>", which then opens the call.
        return (
            f"start: TEXT_NOCALL | head WS? body WS? {close}{more}\n"
            "head[lazy]: /(?s:.)*<tool_call>/\n" + call + text
        )
    return f"start: WS? call{more}\n" + call


def _llama_start(mode: str, content: str | None) -> str:
    text = r"TEXT_NOJSON: /[ \t\n\r]*([^{ \t\n\r](?s:.)*)?/" + "\n"
    if content is not None and mode in ("none", "auto"):
        return f"start: WS? content{' | WS? body' if mode == 'auto' else ''}\ncontent: {content}\n"
    if mode == "none":
        return "start: TEXT_NOJSON\n" + text
    if mode == "auto":
        return "start: TEXT_NOJSON | WS? body\n" + text
    return "start: WS? body\n"


# ---------------------------------------------------------------------------------------------------- parsing

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, syntax: str) -> tuple[str | None, list[dict]]:
    """(content, calls) from generated text; calls are {"name", "arguments"} with arguments a compact JSON string
    (the generated object with the whitespace between tokens removed; keys, order and numbers as generated).

    Text that does not form a valid call stays in the content. Without calls the text is returned unchanged;
    with calls the remaining text is stripped and None when nothing but whitespace remains.
    """
    if syntax == "hermes":
        calls, pieces, pos = [], [], 0
        for m in _HERMES_CALL.finditer(text):
            call = _call_from_json(m.group(1), "arguments")
            if call is None:
                continue
            pieces.append(text[pos : m.start()])
            calls.append(call)
            pos = m.end()
        if not calls:
            return text, []
        pieces.append(text[pos:])
        content = "".join(pieces).strip()
        return content or None, calls
    if syntax == "llama3_json":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].lstrip()
        if body.startswith("{"):
            parts = [body] if _call_from_json(body, "parameters") else re.split(r"\s*;\s*(?=\{)", body)
            calls = [_call_from_json(p, "parameters") for p in parts]
            if calls and all(calls):
                return None, calls
        return text, []
    raise ValueError(f"unknown tool-call syntax {syntax!r}")


def _call_from_json(raw: str, key: str) -> dict | None:
    """{"name", "arguments"} from one call object (`key` holds the arguments; "arguments" is accepted for either
    syntax, as vLLM does), or None if it is not one."""
    compact = compact_json(raw)
    if compact is None:
        return None
    members = _members(compact)
    if members is None or set(members) - {"name", key, "arguments"} or "name" not in members:
        return None
    name = json.loads(members["name"])
    args = members.get(key, members.get("arguments"))
    if not isinstance(name, str) or args is None or not args.startswith("{"):
        return None
    return {"name": name, "arguments": args}


def compact_json(raw: str) -> str | None:
    """`raw` without whitespace outside strings if it is one valid JSON document, else None."""
    out, i, n = [], 0, len(raw)
    while i < n:
        c = raw[i]
        if c == '"':
            j = i + 1
            while j < n and raw[j] != '"':
                j += 2 if raw[j] == "\\" else 1
            out.append(raw[i : j + 1])
            i = j + 1
        else:
            if c not in " \t\n\r":
                out.append(c)
            i += 1
    text = "".join(out)
    try:
        json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return text


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _members(compact: str) -> dict[str, str] | None:
    """Raw value text of each top-level member of a compact JSON object, or None if it is not an object."""
    if not compact.startswith("{"):
        return None
    dec = json.JSONDecoder()
    out: dict[str, str] = {}
    i = 1
    if compact[i] == "}":
        return out
    while True:
        key, i = dec.raw_decode(compact, i)
        if compact[i] != ":":
            return None
        _, end = dec.raw_decode(compact, i + 1)
        out[key] = compact[i + 1 : end]
        i = end
        if compact[i] == "}":
            return out
        i += 1  # ","


# ---------------------------------------------------------------------------------------------------- conversation


def validate_conversation(messages: list[dict], tools: Any, tool_choice: Any) -> None:
    """API version 2 checks on tools and tool messages (reference §3, CHAT-NOTES 14); APIError(400) on the first
    problem. Messages are plain dicts."""
    names: list[str] = []
    if tools is not None:
        names = [n for _, n, _ in _check_tools(tools)]
    if tool_choice is not None:
        if not names:
            raise APIError(400, "'tool_choice' is only allowed when 'tools' are given.", param="tool_choice")
        _choice(tool_choice, names)
    seen_ids: dict[str, str] = {}
    pending: dict[str, int] = {}  # tool-call ids of the latest assistant message, not answered yet
    pending_from = -1
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in seen_ids:
                raise APIError(
                    400,
                    f"Tool message answers tool_call_id {call_id!r}, which no earlier assistant "
                    "message announced.",
                    param=f"messages[{i}].tool_call_id",
                )
            if call_id not in pending:
                raise APIError(
                    400,
                    f"Tool message for tool_call_id {call_id!r} must directly follow the assistant "
                    "message that made the call (one tool message per call).",
                    param=f"messages[{i}].tool_call_id",
                )
            del pending[call_id]
            continue
        if pending:
            raise APIError(
                400,
                f"Tool call(s) {', '.join(map(repr, pending))} of messages[{pending_from}] need a tool message "
                "each, directly after that assistant message.",
                param=f"messages[{i}]",
            )
        if role != "assistant":
            continue
        for j, call in enumerate(msg.get("tool_calls") or []):
            call_id = call.get("id") if isinstance(call, dict) else None
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, "Each tool call needs an 'id'.", param=f"{where}.id")
            if call_id in seen_ids:
                raise APIError(
                    400,
                    f"Duplicate tool call id {call_id!r} (also {seen_ids[call_id]}); ids must be "
                    "unique in a request.",
                    param=f"{where}.id",
                )
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, "A tool call needs function.name.", param=f"{where}.function.name")
            if not isinstance(fn.get("arguments"), str):
                raise APIError(
                    400, "function.arguments must be a JSON string.", param=f"{where}.function.arguments"
                )
            seen_ids[call_id] = where
            pending[call_id] = j
            pending_from = i
    if pending:
        raise APIError(
            400,
            f"Tool call(s) {', '.join(map(repr, pending))} of messages[{pending_from}] need a tool message each, "
            "directly after that assistant message.",
            param=f"messages[{pending_from}].tool_calls",
        )


def new_tool_call_id() -> str:
    """A tool-call id as the hosted service sends them: 9 lowercase hex characters (e.g. '27781e665')."""
    return secrets.token_hex(5)[:9]
