"""IncrementalDetokenizer with a byte-level fake tokenizer: stop strings across tokens and multi-byte characters."""

from __future__ import annotations

from fakes import ByteTokenizer

from waferscale.engine.detokenizer import IncrementalDetokenizer


def feed(detok: IncrementalDetokenizer, tokens: list[int]) -> tuple[str | None, list[str]]:
    """Add tokens until one completes a stop string; the stop string and the released text after each token."""
    released = []
    for t in tokens:
        stop = detok.add(t)
        released.append(detok.release(stop is not None)[0])
        if stop is not None:
            return stop, released
    released.append(detok.release(True)[0])
    return None, released


def test_a_stop_string_split_over_tokens_is_found_cut_and_never_released():
    tok = ByteTokenizer({300: b"Hello EN", 301: b"D! more"})
    detok = IncrementalDetokenizer(tok, [], ["END"])
    stop, released = feed(detok, [300, 301])
    assert stop == "END"
    assert "".join(released) == "Hello " and detok.text == "Hello "


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ["STOP"])
    detok.add(ord("a"))
    detok.add(ord("S"))
    detok.add(ord("T"))
    assert detok.release(False)[0] == "a"  # "ST" could still become "STOP"
    detok.add(ord("x"))
    assert detok.release(False)[0] == "STx"


def test_a_character_split_over_tokens_appears_whole_once_complete():
    euro = "€".encode()  # three bytes, one per token
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], [])
    detok.add(euro[0])
    detok.add(euro[1])
    assert detok.text == ""  # no U+FFFD while the character is incomplete
    detok.add(euro[2])
    assert detok.text == "€"
    text, first, last = detok.release(True)
    assert text == "€" and (first, last) == (0, 3)


def test_a_stop_string_ending_in_a_multibyte_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ["ü!"])
    stop, released = feed(detok, tok.encode("abü!cd"))
    assert stop == "ü!" and "".join(released) == "ab"


def test_stops_before_min_tokens_do_not_count():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ["x"])
    assert detok.add(ord("x")) == "x"
    detok = IncrementalDetokenizer(tok, [], ["x"])
    detok.add(ord("x"), check_stops=False)  # as the engine does while min_tokens is not reached
    detok.ignore_stops_so_far()
    assert detok.add(ord("y")) is None
    assert detok.add(ord("x")) == "x" and detok.text == "xy"


def test_tokens_inside_a_cut_stop_string_are_not_released():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ["##"])
    for t in tok.encode("ab#"):
        detok.add(t)
    assert detok.add(ord("#")) == "##"
    text, first, last = detok.release(True)
    assert text == "ab" and (first, last) == (0, 2)
