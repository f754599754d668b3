"""gpt-oss's harmony output parsed as it streams: analysis → reasoning, final (and commentary without a recipient)
→ content, commentary addressed `to=functions.NAME` → one whole tool call, as openai/harmony's format guide (docs/format.md, v0.0.8) describes it.

The parser reads the generated text with special tokens kept (`<|channel|>`, `<|message|>`, ...), a piece at a time
as the detokenizer releases it; a special token split across pieces is held back until it is whole. The model's
first message follows the prompt's `<|start|>assistant`, so the parser starts inside an assistant header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
_MARKERS = (START, END, MESSAGE, RETURN, CALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")
_PARTIAL = re.compile(r"<\|[a-z_]*\|?")


@dataclass
class HarmonyDelta:
    """What one piece of output adds: reasoning text, content text, or a finished tool call (name, arguments)."""

    reasoning: str = ""
    content: str = ""
    tool_call: tuple[str, str] | None = None


@dataclass
class HarmonyParser:
    """Incremental parser of one assistant reply; `feed` each released piece, `finish` at the end."""

    header: str = ""  # the current message's header text, while in a header
    in_header: bool = True  # the reply starts right after `<|start|>assistant`
    channel: str | None = None
    recipient: str | None = None
    arguments: list[str] = field(default_factory=list)
    pending: str = ""  # text that may be the start of a special token
    ended: str | None = None  # the stop marker seen: <|return|> or <|call|>

    def feed(self, text: str) -> list[HarmonyDelta]:
        """The deltas this piece completes (a partial special token at its end is kept for the next piece)."""
        text, self.pending = self.pending + text, ""
        out: list[HarmonyDelta] = []
        while text and self.ended is None:
            at = text.find("<|")
            if at < 0:
                keep = 1 if text.endswith("<") else 0  # perhaps the start of a special token
                self._text(text[: len(text) - keep], out)
                self.pending = text[len(text) - keep :]
                break
            if at:
                self._text(text[:at], out)
                text = text[at:]
            token = _SPECIAL.match(text)
            if token is None:
                if _PARTIAL.fullmatch(text):  # a special token still arriving
                    self.pending = text
                    break
                self._text("<|", out)  # not a special token: plain text
                text = text[2:]
                continue
            text = text[token.end() :]
            self._token(token.group(), out)
        return [d for d in out if d.reasoning or d.content or d.tool_call]

    def finish(self) -> list[HarmonyDelta]:
        """What is left at the end of generation (a stop token the engine swallowed ends a tool call too)."""
        out: list[HarmonyDelta] = []
        if self.pending:
            self._text(self.pending, out)
            self.pending = ""
        if self.recipient is not None and self.ended is None:
            self._close_message(out, call=True)
        return [d for d in out if d.reasoning or d.content or d.tool_call]

    # ------------------------------------------------------------------ internals
    def _text(self, text: str, out: list[HarmonyDelta]) -> None:
        if self.in_header:
            self.header += text
        elif self.recipient is not None:
            self.arguments.append(text)
        elif self.channel == "analysis":
            out.append(HarmonyDelta(reasoning=text))
        else:  # final, or a preamble on commentary
            out.append(HarmonyDelta(content=text))

    def _token(self, token: str, out: list[HarmonyDelta]) -> None:
        if token == MESSAGE and self.in_header:
            self._open_message()
        elif token in (CHANNEL, CONSTRAIN) and self.in_header:
            self.header += f" {token} "
        elif token == START:
            self.in_header, self.header = True, ""
        elif token in (END, RETURN, CALL):
            self._close_message(out, call=token == CALL)
            if token != END:
                self.ended = token
        elif self.in_header:
            self.header += token
        else:  # an unknown special token inside content: kept as text
            self._text(token, out)

    def _open_message(self) -> None:
        """Read the header: role, ` to=RECIPIENT`, `<|channel|>NAME`, ` <|constrain|>TYPE`, in any of the orders
        the library accepts."""
        head = self.header
        channel = None
        if CHANNEL in head:
            after = head.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
            channel = after[0] if after else None
        recipient = _RECIPIENT.search(head)
        self.channel = channel
        self.recipient = recipient.group(1) if recipient and recipient.group(1).startswith("functions.") else None
        self.in_header, self.header, self.arguments = False, "", []

    def _close_message(self, out: list[HarmonyDelta], call: bool) -> None:
        if self.recipient is not None:
            name = self.recipient.removeprefix("functions.")
            out.append(HarmonyDelta(tool_call=(name, "".join(self.arguments).strip())))
        self.recipient, self.channel, self.arguments = None, None, []
        self.in_header = False
