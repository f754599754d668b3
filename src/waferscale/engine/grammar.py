"""Grammar-constrained decoding: the built-in JSON and function-call grammars, compiled once, matched by llguidance.

Each `grammar_root` names the start rule of one grammar (written out, with examples, in docs/grammar.md). A
constrained sequence owns an `llguidance.LLMatcher`; every step the engine asks `GrammarMasks.fill` for the allowed
tokens of all constrained sequences in the batch at once, and `consume` advances a matcher by the sampled token.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import llguidance
from tokenizers import Tokenizer

if TYPE_CHECKING:
    import torch

# Rules shared by every root. Whitespace follows llama.cpp's json.gbnf (one space, or one newline and up to 20 spaces
# or tabs of indent), so a sampled document cannot drift into endless blank lines; nothing follows a complete value.
_RULES = r"""
value: object | array | string | number | LITERAL
object: "{" ws? (member ("," ws? member)*)? "}"
member: string ws? ":" ws? value ws?
array: "[" ws? (item ("," ws? item)*)? "]"
item: value ws?
string: STRING
number: NUMBER
ws: WS
func: "{" ws? "\"name\"" ws? ":" ws? string ws? "," ws? "\"arguments\"" ws? ":" ws? object ws? "}"
funcarray: "[" ws? func ws? ("," ws? func ws?)* "]"
fcall: func | funcarray
nofcall: TEXT

LITERAL: "true" | "false" | "null"
STRING: /"(\\(["\\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1f\x7f])*"/
NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?/
WS: / |\n[ \t]{0,20}/
TEXT: /[ \t\n\r]*[^\[{ \t\n\r](?s:.)*/
"""

# grammar_root -> start rule. Leading whitespace is allowed before a JSON value (many tokens begin with a space).
_STARTS = {
    "root": "ws? fcall | nofcall",
    "fcall": "ws? fcall",
    "nofcall": "nofcall",
    "insidevalue": "value",  # fed the JSON document the prompt left open, then completes it
    "value": "ws? value",
    "object": "ws? object",
    "array": "ws? array",
    "string": "ws? string",
    "number": "ws? number",
    "funcarray": "ws? funcarray",
    "func": "ws? func",
    "ws": "ws?",
}
GRAMMAR_ROOTS = tuple(_STARTS)
MAX_CACHED_GRAMMARS = 64  # compiled request grammars (tools, schemas) kept for reuse
CALL_ROOTS = frozenset({"root", "fcall", "func", "funcarray"})  # outputs that may be function calls


class GrammarError(Exception):
    """A grammar request that cannot be served; the message is meant for the client."""


def grammar_text(root: str) -> str:
    """The Lark grammar (llguidance dialect) for one root."""
    return f"start: {_STARTS[root]}\n{_RULES}"


def is_function_call(text: str) -> bool:
    """Whether an output of a call-capable root is a function call (it starts with an object or an array)."""
    return text.lstrip()[:1] in ("{", "[")


def open_json_suffix(text: str, limit: int = 256) -> str | None:
    """The JSON object or array that `text` opens and leaves unclosed at its end (outermost first), or None."""
    starts = [i for i, c in enumerate(text) if c in "{["]
    return next((text[i:] for i in starts[-limit:] if _is_open_json_prefix(text[i:])), None)


def _is_open_json_prefix(s: str) -> bool:
    """True if `s` is a proper prefix of a JSON document: valid so far and at least one container still open."""
    stack: list[str] = []
    i, n = 0, len(s)
    expect_value = True
    while i < n:
        c = s[i]
        if c in " \t\n\r":
            i += 1
        elif c in "{[":
            if not expect_value:
                return False
            stack.append("}" if c == "{" else "]")
            i += 1
            expect_value = True
        elif c in "}]":
            if not stack or stack.pop() != c:
                return False
            i += 1
            expect_value = False
            if not stack:
                return False  # closed before the end: this start is not the open one
        elif c == ",":
            if expect_value or not stack:
                return False
            expect_value = True
            i += 1
        elif c == ":":
            if expect_value or not stack or stack[-1] != "}":
                return False
            expect_value = True
            i += 1
        elif c == '"':
            j = i + 1
            while j < n and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            if j >= n:
                return bool(stack)  # an unfinished string at the end is still a valid prefix
            i = j + 1
            expect_value = False
        else:
            j = i
            while j < n and s[j] not in " \t\n\r,:]}":
                j += 1
            word = s[i:j]
            if not expect_value or not _scalar_prefix_ok(word, at_end=j >= n):
                return False
            i = j
            expect_value = False
    return bool(stack)


def _scalar_prefix_ok(word: str, at_end: bool) -> bool:
    if any(lit.startswith(word) if at_end else lit == word for lit in ("true", "false", "null")):
        return True
    allowed = set("0123456789+-.eE")
    return bool(word) and set(word) <= allowed and (word[0] == "-" or word[0].isdigit())


class GrammarMasks:
    """Compiles the built-in grammars for one tokenizer (lazily: the first constrained request pays ~1 s) and
    computes token masks for a batch of matchers in one call."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]):
        self._tokenizer = tokenizer  # serialised for llguidance only when a grammar is first used
        self.vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._templates: dict[str, llguidance.LLMatcher] = {}
        self._lark: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None

    def _ready(self) -> None:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
                import torch  # here, not at the top: the API layer imports open_json_suffix without PyTorch

                # no more mask threads than the engine's own: more would take CPUs from its OpenMP threads
                self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))

    def matcher(self, root: str, prompt: str) -> llguidance.LLMatcher:
        """A fresh matcher for `root`; for insidevalue, already advanced past the JSON the prompt left open."""
        self._ready()
        with self._lock:
            template = self._templates.get(root)
            if template is None:
                template = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(root), log_level=0)
                if template.is_error():
                    raise GrammarError(f"grammar {root!r} failed to compile: {template.get_error()}")
                self._templates[root] = template
        m = template.deep_copy()
        if root == "insidevalue":
            fragment = open_json_suffix(prompt)
            if fragment is None:
                raise GrammarError(
                    "grammar_root 'insidevalue' continues a JSON object or array that the prompt opens and leaves "
                    'unclosed; this prompt has none (end it with, for example, \'{"name": "Ada", \')'
                )
            tokens = self._ll_tokenizer.tokenize_str(fragment)
            if not m.consume_tokens(tokens):
                raise GrammarError(f"the prompt's open JSON cannot be continued: {m.get_error()}")
        return m

    def lark_matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for a whole Lark grammar; the most recent compiled grammars are kept for reuse."""
        self._ready()
        with self._lock:
            template = self._lark.pop(grammar, None)
            if template is None:
                template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
                if template.is_error():
                    raise GrammarError(f"the grammar failed to compile: {template.get_error()}")
            self._lark[grammar] = template  # most recently used last
            while len(self._lark) > MAX_CACHED_GRAMMARS:
                self._lark.pop(next(iter(self._lark)))
        return template.deep_copy()

    def fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Allowed-token bitmasks, one int32 row of ceil(vocab_size / 32) words per matcher (bit j of word w: token
        32 w + j); `allowed` widens rows to bools."""
        # llguidance.torch would do this, but importing it runs torch.compile's imports (~6 s at start-up)
        import torch

        words = (self.vocab_size + 31) // 32
        bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
        if len(matchers) == 1:  # on this thread: handing one mask to the executor's pool costs a thread wake-up
            matchers[0].unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(matchers)
            )
        for m in matchers:
            if m.is_error():
                raise GrammarError(m.get_error())
        return bits

    def allowed(self, bits: torch.Tensor) -> torch.Tensor:
        """A bitmask row (fill's) as a bool row over the vocabulary."""
        import torch

        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(-1)[: self.vocab_size]
