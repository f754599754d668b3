"""Conversations rewritten before a chat template sees them, where the template cannot render them as sent.

Tool fallback, for templates that do not render `tools` themselves (such as the built-in SmolLM2's plain ChatML
template): the conversation is rewritten in the Hermes style that Qwen2.5/Qwen3 templates use, so the template only
ever sees system/user/assistant text (history is rewritten even when no tools are given):

- When tools are given, the tool block is appended to the first system message after a blank line ("\\n\\n"),
  or becomes a new first system message when there is none::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      </tools>

      For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (one tool per line, each as `json.dumps(tool, ensure_ascii=False)`, exactly as the client sent it).
- An assistant message's `tool_calls` become text in its content: the content (if any) then a newline, then for
  each call `<tool_call>\\n{"name": "<name>", "arguments": <arguments as JSON, or the raw string when it was not
  valid JSON>}\\n</tool_call>`, calls separated by a newline.
- `tool` messages become a user message; consecutive tool results share one user message, each as
  `<tool_response>\\n<content>\\n</tool_response>`, joined by a newline.

The model is expected to answer with `<tool_call>` blocks (`tool_syntax == "hermes"`).

Harmony (gpt-oss): one call per assistant message, each followed by its result (transformers renders only the first
call and names every result after it), and every system and developer message joined (blank line between) into one
first message (the template makes only a first one the instructions and drops any other).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TOOL_FALLBACK_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_TOOL_FALLBACK_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = fn.get("name", "")
    args = fn.get("arguments", {})
    if args is None:
        args = {}
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_text}}}\n</tool_call>'


def fallback_tools_block(tools: list[dict]) -> str:
    """The Hermes-style tool definitions and calling instruction put in the system turn."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _TOOL_FALLBACK_HEADER + lines + TOOL_FALLBACK_INSTRUCTIONS


def apply_tool_fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite tool definitions, assistant tool_calls and tool results as text (see the module docstring)."""
    out: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            message = dict(message)
            calls = "\n".join(_tool_call_text(c) for c in message.pop("tool_calls") if isinstance(c, Mapping))
            content = message.get("content")
            content = content if isinstance(content, str) else ""
            message["content"] = content + "\n" + calls if content else calls
        elif role == "tool":
            content = message.get("content")
            block = "<tool_response>\n" + (content if isinstance(content, str) else "") + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            message = {"role": "user", "content": block, "_tool_results": True}
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        block = fallback_tools_block(tools)
        if out and out[0].get("role") == "system":
            content = out[0].get("content")
            content = content if isinstance(content, str) else ""
            out[0] = {**out[0], "content": content + "\n\n" + block if content else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _instructions_first(messages: list[dict]) -> list[dict]:
    """Every system and developer message as one first message, their texts joined by a blank line: gpt-oss's
    template makes only a first system/developer message its developer instructions and drops any other, and the
    hosted service feeds both roles to that layer. A conversation with at most one, first, is unchanged."""
    instructions = [m for m in messages if m.get("role") in ("system", "developer")]
    if not instructions or (len(instructions) == 1 and messages[0] is instructions[0]):
        return messages
    texts = [m["content"] for m in instructions if isinstance(m.get("content"), str) and m["content"]]
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    return [{"role": "developer", "content": "\n\n".join(texts)}, *rest] if texts else rest


def _one_call_per_message(messages: list[dict]) -> list[dict]:
    """Harmony writes one call per assistant message, answered by its result: an assistant message with several
    tool_calls becomes one message per call (the first keeps the content and reasoning), each followed by the tool
    message that answers it. gpt-oss's template renders only a message's first call (and names every following
    result after it), so a conversation with parallel calls would otherwise lose calls."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if not isinstance(calls, list) or len(calls) < 2:
            out.append(message)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        results = {m.get("tool_call_id"): m for m in messages[i + 1 : j]}
        for k, call in enumerate(calls):
            out.append(
                {**message, "tool_calls": [call]} if k == 0 else {"role": "assistant", "tool_calls": [call]}
            )
            answer = results.pop(call.get("id") if isinstance(call, Mapping) else None, None)
            if answer is not None:
                out.append(answer)
        out.extend(results.values())
        i = j
    return out


def harmony_messages(messages: list[dict]) -> list[dict]:
    """The conversation as gpt-oss's harmony template can render all of it."""
    return _one_call_per_message(_instructions_first(messages))
