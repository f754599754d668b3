"""What every tool-call syntax provides (its grammar and its parser), and the arguments rule they share."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection

from waferscale.api.errors import APIError
from waferscale.api.tools.declarations import Function
from waferscale.api.tools.schema import ANY_OBJECT, COMMON_RULES, json_rule, schema_rule


def lit(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text)


def arguments_rule(function: Function) -> str:
    """The %json rule a call's arguments follow: the tool's `parameters` (strict tools: validated subset; others:
    leniently compiled, else any JSON object); no parameters -> the empty object."""
    params = function.spec.get("parameters")
    param = f"tools[{function.index}].function.parameters"
    strict = function.spec.get("strict") is True
    if params is None:
        return json_rule({"type": "object", "properties": {}, "additionalProperties": False})
    if params.get("type", "object") != "object":
        if strict:
            raise APIError(
                400, 'Function parameters must be a schema of "type": "object".', param=f"{param}.type"
            )
        return json_rule(ANY_OBJECT)
    # arguments are always an object: a non-strict schema that leaves out "type" gets it
    schema = params if strict else {**params, "type": "object"}
    return schema_rule(schema, param, strict=strict, what="tool parameters")


class ToolSyntax(ABC):
    """How one family of chat templates writes tool calls: the grammar that holds a turn to it, and the parser
    that reads calls back out of the generated text. One object per syntax, chosen once per model."""

    name: str
    call_prefix: str  # the text a call starts with (held back from a stream until it is known)

    @abstractmethod
    def tool_grammar(
        self,
        functions: list[Function],
        mode: str,
        parallel: bool,
        special_tokens: Collection[str],
        content: str | None,
    ) -> str:
        """Lark text for a tool-calling turn. `mode`: none | auto | required | named:<name> (then `functions` holds
        that one); `content`: the %json rule of a JSON response_format, None for text."""

    def format_grammar(self, content: str, special_tokens: Collection[str]) -> str:
        """Lark text for a turn held to a JSON response_format (`content` is its %json rule), without tools."""
        return f"start: WS? value\nvalue: {content}\n{COMMON_RULES}"

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) from generated text; calls are {"name", "arguments"} with arguments a compact JSON string
        (the generated object with the whitespace between tokens removed; keys, order and numbers as generated).

        Text that does not form a valid call stays in the content. Without calls the text is returned unchanged;
        with calls the remaining text is stripped and None when nothing but whitespace remains."""
