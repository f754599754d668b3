"""Split generated text into reasoning and content for models that think in `<think>...</think>` (Qwen3-style).

The output holds at most one reasoning block, as Qwen3 and DeepSeek-R1 write it:

* Before the block opens, text is content. The start tag opens the block (unless the prompt already opened it:
  `in_reasoning=True`, see `prompt_opens_reasoning`).
* Inside the block, text is reasoning, kept as generated (Qwen3's "\\n" after `<think>` included); the end tag
  closes it. A block never closed (max_tokens reached) stays reasoning to the end.
* After the block, everything is content, verbatim, except the whitespace right after the end tag (the "\\n\\n"
  Qwen3 writes), which is dropped; later tags are not parsed any more.

The tags themselves appear in neither output. Text arrives in arbitrary pieces (a tag may be split across
pieces, "<thi" + "nk>"): `feed` holds back a tail that could still become a tag, and `finish` releases it, so
any split of the same text gives the same result as feeding it whole.
"""

from __future__ import annotations

_BEFORE, _REASONING, _AFTER = 0, 1, 2


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (what may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental splitter: `feed` each piece of generated text, then `finish` once at the end."""

    def __init__(self, *, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.start = start
        self.end = end
        self._state = _REASONING if in_reasoning else _BEFORE
        self._held = ""  # a tail that may be the beginning of the tag looked for
        self._strip = False  # drop whitespace: right after the end tag, until the first other character

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning block."""
        return self._state == _REASONING

    @property
    def reasoning_closed(self) -> bool:
        """Whether the end tag has been seen."""
        return self._state == _AFTER

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of generated text."""
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == _AFTER:
                if self._strip:
                    stripped = text.lstrip()
                    if stripped:
                        self._strip = False
                    text = stripped
                content.append(text)
                break
            tag = self.start if self._state == _BEFORE else self.end
            out = content if self._state == _BEFORE else reasoning
            i = text.find(tag)
            if i < 0:
                keep = _partial_tag(text, tag)
                out.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            out.append(text[:i])
            text = text[i + len(tag) :]
            if self._state == _BEFORE:
                self._state = _REASONING
            else:
                self._state = _AFTER
                self._strip = True
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back: a tail that turned out not to be a tag."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole text: feed then finish."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


def prompt_opens_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (the generation prompt wrote the start tag).

    True when the prompt's last start tag comes after its last end tag and only whitespace follows it (so a
    "<think>" quoted in a user message earlier does not count), as DeepSeek-R1-style templates end with
    "<think>\\n". Qwen3's prompt ends with the assistant header (False), or with an empty closed block when
    thinking is disabled (False)."""
    i = prompt.rfind(start)
    if i < 0:
        return False
    return prompt.rfind(end) < i and not prompt[i + len(start) :].strip()
