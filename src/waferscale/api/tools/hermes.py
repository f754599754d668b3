"""The hermes tool-call syntax (Qwen2.5/Qwen3/Hermes templates; our fallback for templates without tool support)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parallel calls follow one another, separated by a newline. In ``auto`` mode a call may follow some text. When the
tokenizer has ``<tool_call>``/``</tool_call>`` as tokens of their own, llguidance treats them as special tokens (it
does so for every added token spelled ``<...>``), so the grammar names them as tokens (see
`grammar_special_tokens`); otherwise they are spelled as text.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from waferscale.api.tools.base import ToolSyntax, lit
from waferscale.api.tools.declarations import Function
from waferscale.api.tools.json_calls import call_from_json, call_object_rules
from waferscale.api.tools.schema import COMMON_RULES

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class HermesSyntax(ToolSyntax):
    """Calls as JSON objects inside <tool_call> tags, after optional text."""

    name = "hermes"
    call_prefix = "<tool_call>"

    def tool_grammar(
        self,
        functions: list[Function],
        mode: str,
        parallel: bool,
        special_tokens: Collection[str],
        content: str | None,
    ) -> str:
        body = call_object_rules(functions, "arguments")
        parallel = parallel and not mode.startswith("named:")  # a named choice calls it once
        return _hermes_start(mode, parallel, special_tokens, content) + body + COMMON_RULES

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        calls, pieces, pos = [], [], 0
        for m in _CALL.finditer(text):
            call = call_from_json(m.group(1), "arguments")
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


def _hermes_start(mode: str, parallel: bool, special_tokens: Collection[str], content: str | None) -> str:
    special_open = "<tool_call>" in special_tokens
    open_ = "<tool_call>" if special_open else lit("<tool_call>")
    close = "</tool_call>" if "</tool_call>" in special_tokens else lit("</tool_call>")
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
