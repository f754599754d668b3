"""The tools a request declares and its tool_choice: shape, names and duplicates checked, the choice resolved."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from waferscale.api.errors import APIError

TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class Function:
    """One declared function tool: its place in `tools` (for error paths), its name and its `function` object."""

    index: int
    name: str
    spec: dict


def grammar_special_tokens(tokenizer) -> frozenset[str]:
    """The added tokens llguidance treats as special for a `tokenizers.Tokenizer` (those marked special, and every
    added token spelled ``<...>``): pass it to `tool_grammar` so it names ``<tool_call>`` as a token when it is one.
    """
    return frozenset(
        t.content
        for t in tokenizer.get_added_tokens_decoder().values()
        if t.special or (t.content.startswith("<") and t.content.endswith(">"))
    )


def check_tools(tools: Any) -> list[Function]:
    """The declared functions after checking shape, names (charset, length) and duplicates."""
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
        out.append(Function(i, name, fn))
    return out


def resolve_choice(tool_choice: Any, names: Collection[str]) -> str:
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
