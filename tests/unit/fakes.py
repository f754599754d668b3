"""Small stand-ins for the model's pieces, so the engine's pure parts run without loading a model."""

from __future__ import annotations

from waferscale.engine.params import SamplingParams
from waferscale.engine.sequence import Sequence


class ByteTokenizer:
    """Token id i < 256 is byte i; higher ids are the multi-byte pieces in `pieces`. Decoding replaces an
    incomplete UTF-8 sequence with U+FFFD, as real byte-level tokenizers do."""

    def __init__(self, pieces: dict[int, bytes] | None = None):
        self.pieces = pieces or {}

    def piece(self, token: int) -> bytes:
        return self.pieces.get(token, bytes([token]) if token < 256 else b"")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(t) for t in ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", errors="replace")


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params), detokenizer=None)
