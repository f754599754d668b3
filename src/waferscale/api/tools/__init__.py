"""Tools and structured outputs for /v1/chat/completions: request checks, Lark grammars for llguidance, parsing.

Pure functions, no model: the engine constrains a sequence with the Lark text these return (`SamplingParams.lark`),
and a syntax's `parse` splits the generated text back into content and calls. One module per tool-call syntax, each
with its grammar and its parser, as vLLM keeps its tool parsers: `hermes`, `llama3_json`, `harmony`; the JSON
schema checks and rules in `schema`, the declared tools and tool_choice in `declarations`, conversation checks in
`conversation`. A model's chat template names its syntax (`ChatTemplate.tool_syntax`); `syntax(name)` gives the
object, chosen once.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from waferscale.api.tools.base import ToolSyntax
from waferscale.api.tools.conversation import new_tool_call_id, validate_conversation
from waferscale.api.tools.declarations import (
    TOOL_CHOICES,
    Function,
    check_tools,
    grammar_special_tokens,
    resolve_choice,
)
from waferscale.api.tools.harmony import HarmonySyntax
from waferscale.api.tools.hermes import HermesSyntax
from waferscale.api.tools.json_calls import compact_json
from waferscale.api.tools.llama3_json import Llama3JsonSyntax
from waferscale.api.tools.schema import FORMATS, format_rule, response_format_grammar, validate_strict_schema

_SYNTAXES: dict[str, ToolSyntax] = {s.name: s for s in (HermesSyntax(), Llama3JsonSyntax(), HarmonySyntax())}
SYNTAXES = tuple(_SYNTAXES)

__all__ = [
    "FORMATS",
    "SYNTAXES",
    "TOOL_CHOICES",
    "Function",
    "ToolSyntax",
    "compact_json",
    "format_grammar",
    "grammar_special_tokens",
    "new_tool_call_id",
    "parse_tool_calls",
    "response_format_grammar",
    "syntax",
    "tool_grammar",
    "validate_conversation",
    "validate_strict_schema",
]


def syntax(name: str | ToolSyntax) -> ToolSyntax:
    """The tool-call syntax called `name` (ValueError for an unknown one)."""
    if isinstance(name, ToolSyntax):
        return name
    if name not in _SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {name!r}")
    return _SYNTAXES[name]


def tool_grammar(
    tools: list[dict] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    syntax_name: str | ToolSyntax,
    *,
    special_tokens: Collection[str] = (),
    response_format: dict | None = None,
) -> str | None:
    """Lark text for a tool-calling turn, or None when there are no tools.

    none -> text that never starts a call (tools stay in the prompt, so a model may try to call: the grammar makes
    sure it cannot); auto -> text, or calls (hermes: optionally after some text); required -> one or more calls
    (exactly one unless parallel; one per turn for llama3_json and harmony); named -> exactly that function, once.
    A started call always completes validly; arguments follow each tool's `parameters` (strict tools: validated
    subset; others: leniently compiled, else any JSON object). The grammar ends after the last call.

    `special_tokens`: the tokens llguidance treats as special for the model's tokenizer (`grammar_special_tokens`).
    `response_format`: when it asks for JSON, the content alternative (none, auto) is that JSON instead of text;
    in auto mode, hermes then allows no text before a call.
    """
    chosen = syntax(syntax_name)
    if not tools:
        return None
    functions = check_tools(tools)
    mode = resolve_choice(tool_choice, [f.name for f in functions])
    content = format_rule(response_format)
    if mode.startswith("named:"):
        functions = [f for f in functions if f.name == mode[6:]]
    return chosen.tool_grammar(functions, mode, parallel_tool_calls, special_tokens, content)


def format_grammar(
    response_format: dict | None, syntax_name: str | ToolSyntax, special_tokens: Collection[str] = ()
) -> str | None:
    """Lark text that holds a turn without tools to `response_format` in the syntax's turn shape (harmony: the final
    message, after the reasoning), or None for plain text (see `response_format_grammar` for the rules)."""
    rule = format_rule(response_format)
    return None if rule is None else syntax(syntax_name).format_grammar(rule, special_tokens)


def parse_tool_calls(text: str, syntax_name: str | ToolSyntax) -> tuple[str | None, list[dict]]:
    """(content, calls) from generated text, as the syntax reads it (see `ToolSyntax.parse`)."""
    return syntax(syntax_name).parse(text)
