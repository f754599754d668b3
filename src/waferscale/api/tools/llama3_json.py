"""The llama3_json tool-call syntax (Llama 3.1/3.2 templates): the whole turn is one JSON object
``{"name": "get_weather", "parameters": {"city": "Paris"}}``. One call per turn: the Llama templates refuse to render
more than one call in history, so ``parallel_tool_calls`` does not add more.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from waferscale.api.tools.base import ToolSyntax
from waferscale.api.tools.declarations import Function
from waferscale.api.tools.json_calls import call_from_json, call_object_rules
from waferscale.api.tools.schema import COMMON_RULES


class Llama3JsonSyntax(ToolSyntax):
    """A call is the whole turn: one bare JSON object with "name" and "parameters"."""

    name = "llama3_json"
    call_prefix = "{"

    def tool_grammar(
        self,
        functions: list[Function],
        mode: str,
        parallel: bool,
        special_tokens: Collection[str],
        content: str | None,
    ) -> str:
        return _llama_start(mode, content) + call_object_rules(functions, "parameters") + COMMON_RULES

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].lstrip()
        if body.startswith("{"):
            parts = [body] if call_from_json(body, "parameters") else re.split(r"\s*;\s*(?=\{)", body)
            calls = [call_from_json(p, "parameters") for p in parts]
            if calls and all(calls):
                return None, calls
        return text, []


def _llama_start(mode: str, content: str | None) -> str:
    text = r"TEXT_NOJSON: /[ \t\n\r]*([^{ \t\n\r](?s:.)*)?/" + "\n"
    if content is not None and mode in ("none", "auto"):
        return f"start: WS? content{' | WS? body' if mode == 'auto' else ''}\ncontent: {content}\n"
    if mode == "none":
        return "start: TEXT_NOJSON\n" + text
    if mode == "auto":
        return "start: TEXT_NOJSON | WS? body\n" + text
    return "start: WS? body\n"
