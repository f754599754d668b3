"""Incremental detokenizer: per-token text deltas, stop strings matched across tokens, and hold-back for streams."""

from __future__ import annotations

from waferscale.models.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context (leading-space handling of some tokenizers)


class IncrementalDetokenizer:
    """Tracks the completion text and, for each generated token, where its text starts.

    Text is released to the client only once no stop string can begin inside it; a stop string is never returned.
    """

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.offsets: list[int] = []  # start of each generated token's text
        self.stop_from = 0  # stop strings are searched from here on (min_tokens moves it)
        self.released_text = 0
        self.released_tokens = 0
        self.cut_at: int | None = None  # where a matched stop string was cut off

    def add(self, token_id: int, check_stops: bool = True) -> str | None:
        """Append a token; return the stop string it completed, if any (the text is then cut before it).

        check_stops=False (while min_tokens is not reached) leaves the text whole whatever it holds."""
        self.ids.append(token_id)
        self.offsets.append(len(self.text))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop or not check_stops:
            return None
        start = max(self.stop_from, len(self.text) - self.max_stop - 8)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.cut_at = best[0]
        return best[1]

    def ignore_stops_so_far(self) -> None:
        """While min_tokens is not reached, stop strings in the text so far do not count."""
        self.stop_from = len(self.text)

    def _holdback(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, finished: bool) -> tuple[str, int, int]:
        """Newly releasable text and the [first, last) range of generated tokens it covers.

        At the end every token is released except those lying wholly inside a cut-off stop string.
        """
        end = len(self.text) if finished else max(self.released_text, len(self.text) - self._holdback())
        text = self.text[self.released_text : end]
        self.released_text = end
        first = last = self.released_tokens
        n = len(self.offsets)
        while last < n:
            start = self.offsets[last]
            if finished:
                if self.cut_at is not None and start >= self.cut_at:
                    break
            elif (self.offsets[last + 1] if last + 1 < n else len(self.text)) > end:
                break
            last += 1
        self.released_tokens = last
        return text, first, last
