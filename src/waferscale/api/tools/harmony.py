"""The harmony tool-call syntax (gpt-oss): a call is a `commentary` message addressed to the function, its arguments
JSON, ended by `<|call|>`; the turn's reasoning comes first on `analysis`, the answer on `final`::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with `<|start|>assistant`, so the reply starts at the channel). The grammar writes the header as
openai/harmony's format guide does; the parser (api/harmony.py) also reads the recipient next to the role, as the
chat template renders history. One call per turn: the model stops at `<|call|>` to get the result, and the template
renders one call per assistant message. Harmony's markers are tokens of their own in gpt-oss's tokenizer, so the
grammar names them as tokens (spelled as text for a tokenizer that lacks them). Text on a channel cannot contain
`<|`, so no marker can be spelled in text.
"""

from __future__ import annotations

from collections.abc import Collection

from waferscale.api.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, HarmonyParser
from waferscale.api.tools.base import ToolSyntax, arguments_rule, lit
from waferscale.api.tools.declarations import Function
from waferscale.api.tools.json_calls import compact_json

_TEXT = r"TEXT: /(?s:.)*/ & ~/(?s:.*)<\|(?s:.*)/" + "\n"


def _markers(special_tokens: Collection[str]):
    """A marker in Lark: its token where the tokenizer has it as a special token, else its text."""
    return lambda marker: marker if marker in special_tokens else lit(marker)


class HarmonySyntax(ToolSyntax):
    """gpt-oss's channels: analysis messages, then a final answer or one function call on commentary."""

    name = "harmony"
    call_prefix = "<|channel|>commentary to=functions."

    def tool_grammar(
        self,
        functions: list[Function],
        mode: str,
        parallel: bool,
        special_tokens: Collection[str],
        content: str | None,
    ) -> str:
        tok = _markers(special_tokens)
        calls = []
        for i, function in enumerate(functions):
            calls.append(
                f"call{i}: {tok(CHANNEL)} {lit(f'commentary to=functions.{function.name} ')} {tok(CONSTRAIN)} "
                f'"json" {tok(MESSAGE)} args{i} {tok(CALL)}\nargs{i}: {arguments_rule(function)}\n'
            )
        call = "call: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n" + "".join(calls)
        answer = {"none": "final", "auto": "final | call"}.get(mode, "call")
        return self._turn(answer, special_tokens, content) + (call if answer != "final" else "")

    def format_grammar(self, content: str, special_tokens: Collection[str]) -> str:
        return self._turn("final", special_tokens, content)

    def _turn(self, answer: str, special_tokens: Collection[str], content: str | None) -> str:
        """`start`: analysis messages, then `answer`; the final message's body is `content` (JSON) or text."""
        tok = _markers(special_tokens)
        body = content if content is not None else "TEXT"
        return (
            f"start: analysis* ({answer})\n"
            f'analysis: {tok(CHANNEL)} "analysis" {tok(MESSAGE)} TEXT {tok(END)} {tok(START)} "assistant"\n'
            f'final: {tok(CHANNEL)} "final" {tok(MESSAGE)} final_body {tok(RETURN)}\n'
            f"final_body: {body}\n" + _TEXT
        )

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        parser = HarmonyParser()
        deltas = parser.feed(text) + parser.finish()
        content = "".join(d.content for d in deltas)
        calls = [
            {"name": name, "arguments": compact_json(args) or args}
            for name, args in (d.tool_call for d in deltas if d.tool_call)
        ]
        if not calls:
            return content, []
        return content.strip() or None, calls
