"""Render a conversation with the model's own chat template, as Hugging Face `transformers` does.

The reference is `transformers`' `apply_chat_template` (read in `transformers/utils/chat_template_utils.py` and
`tokenization_utils_base.py`); this module reproduces its behaviour without importing it:

* The template runs in `jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
  the `loopcontrols` extension and a no-op `{% generation %}...{% endgeneration %}` block (transformers uses it to
  track assistant tokens; it renders its body unchanged).
* Filter `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` is `json.dumps` with those
  arguments (no HTML escaping, unlike Jinja's own). Globals: `raise_exception(message)` (raises our
  `TemplateError`, whose message goes to the client as a 400), `strftime_now(format)` (local time), `dict(...)`
  and `namespace(...)` (which refuses attribute names starting with "_").
* Messages are copied to plain JSON data, keys whose value is None are dropped (many templates print "None" or
  fail on `content: null` but handle a missing key), and an assistant's reasoning (`reasoning_content`, or older
  `thinking`/`reasoning`) is passed under both `reasoning_content` and `thinking`.
* Template variables: `messages`, `tools` (None when not given), `documents` (None), `add_generation_prompt`,
  the tokenizer's named special tokens as strings (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
  `pad_token`, `cls_token`, `mask_token`, those it has), and `enable_thinking` only when the caller sets it.
* The rendered text is tokenized WITHOUT adding special tokens: the template writes BOS itself when it wants one.

What transformers does not do, and we add on top:

* A model without a chat template (a base model's GGUF or folder) gets its family's default,
  `default_chat_template(architecture)`: gpt-oss's own template for gpt-oss, Gemma's turn markers for Gemma (`DEFAULT_GEMMA`: `<bos>`, then
  `<start_of_turn>user\\n{content}<end_of_turn>\\n` per message, `model` for the assistant, a system message
  folded into the first user turn as Gemma's own template does, then `<start_of_turn>model\\n` for the generation
  prompt), ChatML for every other family (`DEFAULT_CHATML`: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
  message, then `<|im_start|>assistant\\n`). Unlike Gemma's own template, the default accepts any order of roles.
* A `developer` message becomes a `system` message unless the template itself knows the role.
* gpt-oss's harmony template (it writes `<|channel|>`; `harmony`, `tool_syntax == "harmony"`): the conversation
  is rewritten first (`chat_rewrites.harmony_messages`: one call per assistant message, every system and developer
  message joined into the first). `reasoning_effort` reaches the template as a variable when the caller sets it,
  as transformers passes extra keyword arguments.
* Tool fallback, for templates that do not render `tools` themselves (such as the built-in SmolLM2's plain
  ChatML template): the conversation is rewritten in the Hermes style that Qwen2.5/Qwen3 templates use
  (`chat_rewrites.apply_tool_fallback`, which documents the text), so the template only ever sees
  system/user/assistant text; the model is expected to answer with `<tool_call>` blocks (`tool_syntax ==
  "hermes"`).
* Where the template fails on a message whose content is null (transformers drops the key, and templates such
  as Qwen3's read an assistant turn's content as text even when it only holds tool calls), the conversation is
  rendered again with "" for those contents. Conversations transformers renders are never affected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from waferscale.models.chat_rewrites import apply_tool_fallback, fallback_tools_block, harmony_messages
from waferscale.models.default_templates import DEFAULT_CHATML, DEFAULT_GEMMA, default_chat_template

if TYPE_CHECKING:
    from waferscale.models.tokenizer import ModelTokenizer

__all__ = [
    "DEFAULT_CHATML",
    "DEFAULT_GEMMA",
    "ChatTemplate",
    "TemplateError",
    "default_chat_template",
    "fallback_tools_block",
]


class TemplateError(Exception):
    """A conversation the template refuses (raise_exception) or cannot render; message for the client."""


# Names a message's reasoning arrives under; the first is the one templates read (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_PROBE_TOOL_NAME = "waferscale_probe_tool_7f3a9c"


# ---------------------------------------------------------------- the sandbox


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' AssistantTracker with tracking off renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only (what the sandbox may safely see); anything else becomes '<type>'."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _template_messages(messages: list[dict]) -> list[dict]:
    """transformers' normalisation: drop None-valued keys, plain copies, reasoning under both names."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be objects, got {type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# ---------------------------------------------------------------- the template


class ChatTemplate:
    """A model's chat template, compiled once; `render` turns OpenAI-shaped messages into the prompt text."""

    supports_tools: bool
    supports_developer: bool
    harmony: bool  # gpt-oss's harmony format (the template writes <|channel|>)
    reasoning: bool  # the model reasons: <think> tags, or harmony's analysis channel
    tool_syntax: str  # hermes | llama3_json | harmony (api/tools)

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        architecture: str = "",
    ):
        """`source` None means the family's default (default_chat_template(architecture); ChatML when unknown);
        `special_tokens` may add unk_token, pad_token, ... (strings)."""
        self.source = source if source else default_chat_template(architecture)
        self.is_default = not source
        tokens = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
        if bos_token is not None:
            tokens["bos_token"] = bos_token
        if eos_token is not None:
            tokens["eos_token"] = eos_token
        self.special_tokens = tokens
        env = _environment()
        try:
            ast = env.parse(self.source)
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template is not valid Jinja: {exc}") from exc
        literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
        literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
        literal_text = "\0".join(literals)
        variables = jinja2.meta.find_undeclared_variables(ast)
        self.supports_developer = "developer" in literal_text
        self.harmony = "<|channel|>" in literal_text  # gpt-oss: channels, reasoning on analysis
        self.reasoning = self.harmony or "<think>" in literal_text or "</think>" in literal_text
        self.supports_tools = self._renders_tools("tools" in variables)
        if self.harmony:
            self.tool_syntax = "harmony"
        elif self.supports_tools and "<tool_call>" not in literal_text and '"parameters"' in literal_text:
            self.tool_syntax = "llama3_json"
        else:
            self.tool_syntax = "hermes"

    @classmethod
    def for_tokenizer(cls, tok: ModelTokenizer) -> ChatTemplate:
        """The tokenizer's template (its family's default when it has none) and special-token strings
        (TokenizerInfo.extra['special_tokens'] and ['architecture'])."""
        info = tok.info
        extra = info.extra or {}
        tokens = dict(extra.get("special_tokens") or {})
        if "bos_token" not in tokens and info.bos_token_id is not None:
            tokens["bos_token"] = tok.token_text(info.bos_token_id)
        if "eos_token" not in tokens and info.eos_token_ids:  # a folder converted before they were saved
            tokens["eos_token"] = tok.token_text(info.eos_token_ids[0])
        return cls(info.chat_template, special_tokens=tokens, architecture=extra.get("architecture") or "")

    def _renders_tools(self, mentions_tools: bool) -> bool:
        """Whether the template puts a tool definition in the prompt (probed; the static answer if it refuses)."""
        if not mentions_tools:
            return False
        fn = {"name": _PROBE_TOOL_NAME, "description": "", "parameters": {}}
        probe = [{"type": "function", "function": fn}]
        try:
            text = self._render([{"role": "user", "content": "hi"}], probe, True, None)
        except TemplateError:
            return True
        return _PROBE_TOOL_NAME in text

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI shape); raises TemplateError with a message for the client.

        `enable_thinking` and `reasoning_effort` reach the template as variables when set (as transformers passes
        extra keyword arguments): Qwen3-style templates read the first, gpt-oss's the second."""
        messages = [dict(m) for m in messages]
        if not self.supports_developer:
            for m in messages:
                if m.get("role") == "developer":
                    m["role"] = "system"
        if not self.supports_tools:
            messages = apply_tool_fallback(messages, tools)
            tools = None
        if self.harmony:
            messages = harmony_messages(messages)
        extra = {"reasoning_effort": reasoning_effort} if reasoning_effort is not None else {}
        return self._render(messages, tools, add_generation_prompt, enable_thinking, extra)

    def _render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = dict(self.special_tokens)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        variables.update(extra or {})
        variables.update(tools=_plain(tools), documents=None, add_generation_prompt=add_generation_prompt)
        try:
            try:
                return self._template.render(messages=_template_messages(messages), **variables)
            except (jinja2.UndefinedError, TypeError):
                # transformers fails here too. A null content (an assistant turn holding only tool calls) that
                # the template reads as text gets a second try as "", which every template can read.
                if not any(m.get("content", "") is None for m in messages):
                    raise
                messages = [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]
                return self._template.render(messages=_template_messages(messages), **variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template cannot render this conversation: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            raise TemplateError(
                f"the model's chat template cannot render this conversation: {type(exc).__name__}: {exc}"
            ) from exc
