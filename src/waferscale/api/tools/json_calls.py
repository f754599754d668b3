"""Calls written as one JSON object `{"name": ..., <key>: {...}}` (hermes inside its tags, llama3_json bare): the
grammar rule of such an object for each function, and reading one back."""

from __future__ import annotations

import json

from waferscale.api.tools.base import arguments_rule, lit
from waferscale.api.tools.declarations import Function


def call_object_rules(functions: list[Function], key: str) -> str:
    """Lark rules `body` (any of the functions' call objects) and `body<i>`/`args<i>` for each function."""
    rules = []
    for i, function in enumerate(functions):
        rule = arguments_rule(function)
        rules.append(
            f'body{i}: "{{" WS? "\\"name\\"" WS? ":" WS? {lit(json.dumps(function.name))} WS? "," WS? '
            f'{lit(json.dumps(key))} WS? ":" WS? args{i} WS? "}}"\nargs{i}: {rule}\n'
        )
    return "body: " + " | ".join(f"body{i}" for i in range(len(functions))) + "\n" + "".join(rules)


def call_from_json(raw: str, key: str) -> dict | None:
    """{"name", "arguments"} from one call object (`key` holds the arguments; "arguments" is accepted for either
    syntax, as vLLM does), or None if it is not one."""
    compact = compact_json(raw)
    if compact is None:
        return None
    fields = members(compact)
    if fields is None or set(fields) - {"name", key, "arguments"} or "name" not in fields:
        return None
    name = json.loads(fields["name"])
    args = fields.get(key, fields.get("arguments"))
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


def members(compact: str) -> dict[str, str] | None:
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
