"""A conversation's tool calls and tool messages checked as API version 2 does, and new tool-call ids."""

from __future__ import annotations

import secrets
from typing import Any

from waferscale.api.errors import APIError
from waferscale.api.tools.declarations import check_tools, resolve_choice


def validate_conversation(messages: list[dict], tools: Any, tool_choice: Any) -> None:
    """API version 2 checks on tools and tool messages (reference §3, CHAT-NOTES 14); APIError(400) on the first
    problem. Messages are plain dicts."""
    names: list[str] = []
    if tools is not None:
        names = [f.name for f in check_tools(tools)]
    if tool_choice is not None:
        if not names:
            raise APIError(400, "'tool_choice' is only allowed when 'tools' are given.", param="tool_choice")
        resolve_choice(tool_choice, names)
    seen_ids: dict[str, str] = {}
    pending: dict[str, int] = {}  # tool-call ids of the latest assistant message, not answered yet
    pending_from = -1
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in seen_ids:
                raise APIError(
                    400,
                    f"Tool message answers tool_call_id {call_id!r}, which no earlier assistant "
                    "message announced.",
                    param=f"messages[{i}].tool_call_id",
                )
            if call_id not in pending:
                raise APIError(
                    400,
                    f"Tool message for tool_call_id {call_id!r} must directly follow the assistant "
                    "message that made the call (one tool message per call).",
                    param=f"messages[{i}].tool_call_id",
                )
            del pending[call_id]
            continue
        if pending:
            raise APIError(
                400,
                f"Tool call(s) {', '.join(map(repr, pending))} of messages[{pending_from}] need a tool message "
                "each, directly after that assistant message.",
                param=f"messages[{i}]",
            )
        if role != "assistant":
            continue
        for j, call in enumerate(msg.get("tool_calls") or []):
            call_id = call.get("id") if isinstance(call, dict) else None
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, "Each tool call needs an 'id'.", param=f"{where}.id")
            if call_id in seen_ids:
                raise APIError(
                    400,
                    f"Duplicate tool call id {call_id!r} (also {seen_ids[call_id]}); ids must be "
                    "unique in a request.",
                    param=f"{where}.id",
                )
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, "A tool call needs function.name.", param=f"{where}.function.name")
            if not isinstance(fn.get("arguments"), str):
                raise APIError(
                    400, "function.arguments must be a JSON string.", param=f"{where}.function.arguments"
                )
            seen_ids[call_id] = where
            pending[call_id] = j
            pending_from = i
    if pending:
        raise APIError(
            400,
            f"Tool call(s) {', '.join(map(repr, pending))} of messages[{pending_from}] need a tool message each, "
            "directly after that assistant message.",
            param=f"messages[{pending_from}].tool_calls",
        )


def new_tool_call_id() -> str:
    """A tool-call id as the hosted service sends them: 9 lowercase hex characters (e.g. '27781e665')."""
    return secrets.token_hex(5)[:9]
