"""One chat choice of a harmony model (gpt-oss), built event by event: analysis → reasoning, final → content,
a commentary call to a function → a tool call; reasoning tokens and logprobs attributed token by token.

The engine keeps the special tokens in the text of a harmony request (`SamplingParams.skip_special_tokens=False`),
so the parser sees the channels. Where the reasoning goes follows `reasoning_format`: parsed and text_parsed to
`reasoning` (parsed also splits the logprobs), raw into the content right before the answer (no separator, as the
hosted service does for gpt-oss), hidden nowhere (still generated and counted). Tokens of the format itself
(headers, markers) and of a call's arguments are in no logprobs list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from waferscale.api import tools as tooling
from waferscale.api.harmony import HarmonyParser
from waferscale.engine import GenerationEvent
from waferscale.models.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    from waferscale.api.chat import ChatPlan

_REASONING, _CONTENT, _FORMAT = 0, 1, 2


@dataclass
class HarmonyOutput:
    """The same interface as chat.ChoiceOutput: `add` each event, `finish` at the end."""

    plan: ChatPlan
    content: str = ""
    reasoning: str = ""
    reasoning_tokens: int = 0
    content_logprobs: list[dict] = field(default_factory=list)
    reasoning_logprobs: list[dict] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    parser: HarmonyParser = field(default_factory=HarmonyParser)  # the text, as released
    tokens: HarmonyParser = field(default_factory=HarmonyParser)  # token by token: what each token is

    def add(self, ev: GenerationEvent, tok: ModelTokenizer) -> dict:
        """The delta this event adds: {'content'?, 'reasoning'?, 'logprobs'?, 'reasoning_logprobs'?}."""
        from waferscale.api.chat import logprob_entries  # chat imports this module

        fmt = self.plan.reasoning_format
        deltas = self.parser.feed(ev.text) + (self.parser.finish() if ev.finished else [])
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        if self.plan.tool_mode is not None:
            self.calls += [d.tool_call for d in deltas if d.tool_call]
        kinds = [self._kind(tok.token_text(t)) for t in ev.token_ids]
        self.reasoning_tokens += kinds.count(_REASONING)
        delta: dict = {}
        if fmt == "raw":
            reasoning, content = "", reasoning + content
        if reasoning and fmt in ("parsed", "text_parsed"):
            self.reasoning += reasoning
            delta["reasoning"] = reasoning
        if content:
            self.content += content
            delta["content"] = content
        if self.plan.top_logprobs is not None and ev.logprobs:
            entries = logprob_entries(ev.logprobs, self.plan.top_logprobs, tok)
            for entry, kind in zip(entries, kinds):
                if kind == _FORMAT or (kind == _REASONING and fmt == "hidden"):
                    continue
                key = "reasoning_logprobs" if kind == _REASONING and fmt == "parsed" else "logprobs"
                delta.setdefault(key, []).append(entry)
            self.content_logprobs += delta.get("logprobs", [])
            self.reasoning_logprobs += delta.get("reasoning_logprobs", [])
        return delta

    def _kind(self, piece: str) -> int:
        """What a token is, fed to the token-level parser: reasoning text, content text, or format/arguments."""
        deltas = self.tokens.feed(piece)
        if any(d.reasoning for d in deltas):
            return _REASONING
        if any(d.content for d in deltas):
            return _CONTENT
        held = self.tokens
        if held.pending and not held.in_header and held.recipient is None:  # text held back (a "<" so far)
            return _REASONING if held.channel == "analysis" else _CONTENT
        return _FORMAT

    def finish(self) -> tuple[list[dict], str]:
        """The calls made (each with a fresh id; arguments compact JSON) and content not yet sent (none)."""
        made = [
            {
                "id": tooling.new_tool_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": tooling.compact_json(args) or args},
            }
            for name, args in self.calls
        ]
        return made, ""
