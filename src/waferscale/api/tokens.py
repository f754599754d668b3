"""A token as the API shows it: its own bytes (a byte-level piece may hold part of a UTF-8 character), and the
name legacy completions logprobs give it (OpenAI's `bytes:\\xNN...` for a token that is not whole UTF-8 text)."""

from __future__ import annotations

import functools
import re

from tokenizers import decoders

from waferscale.models.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a vocabulary entry uses for each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok: ModelTokenizer, token_id: int, text: str) -> list[int]:
    """A token's own bytes (a byte-level piece may be part of a UTF-8 character, which its text cannot show)."""
    piece = tok.tokenizer.id_to_token(token_id)
    if piece is not None and isinstance(tok.tokenizer.decoder, decoders.ByteLevel):
        table = _byte_decoder()
        if all(c in table for c in piece):
            return [table[c] for c in piece]
    if piece is not None and (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):
        return [int(m.group(1), 16)]
    return list(text.encode("utf-8", "surrogatepass"))


def token_name(tok: ModelTokenizer, token_id: int | None, text: str) -> str:
    """How completions logprobs name a token: its text when its bytes are whole UTF-8, else `bytes:` and its bytes
    as `\\xNN` escapes (as OpenAI names them), so that tokens whose text is the same U+FFFD stay apart."""
    if REPLACEMENT not in text or token_id is None:
        return (
            text  # whole text, or several tokens decode to this text and without the id its bytes are unknown
        )
    raw = bytes(token_bytes(tok, token_id, text))
    try:
        raw.decode("utf-8")
        return text  # a real U+FFFD (or text decoded from whole characters)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def top_named(tok: ModelTokenizer, top: list[tuple[int, str, float]] | None) -> dict[str, float]:
    """A completions top_logprobs dict, keyed by token name (distinct for every token, byte tokens included)."""
    return {token_name(tok, token_id, text): value for token_id, text, value in top or []}
