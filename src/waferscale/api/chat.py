"""POST /v1/chat/completions: messages -> the model's own chat template -> the engine -> chat choices.

A chat request is a completion of the rendered conversation: the same engine path, the same sampling controls.
What is chat's own: messages and their checks, tools and response formats (a grammar the engine decodes under),
reasoning placement, the chat logprobs shape, and the hosted service's streaming order (role chunk first, tool
calls whole in one chunk, usage and time_info on the chunk that carries the last finish_reason).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import ValidationError as PydanticValidationError

from waferscale.api import tools as tooling
from waferscale.api.chat_schemas import ChatCompletionRequest, TextContent
from waferscale.api.errors import APIError, engine_error
from waferscale.api.harmony import CALL, RETURN
from waferscale.api.harmony_output import HarmonyOutput
from waferscale.api.pipeline import (
    MAX_SEQUENCES,
    SSE_DONE,
    Run,
    ServingContext,
    check_model,
    encode,
    prompt_overflows,
    sampling_params,
    sse,
    stop_list,
    token_limits,
)
from waferscale.api.reasoning import ReasoningSplitter, prompt_opens_reasoning
from waferscale.api.tokens import token_bytes
from waferscale.engine import GenerationEvent, SamplingParams, TokenLogprob
from waferscale.models.chat_template import ChatTemplate, TemplateError
from waferscale.models.tokenizer import ModelTokenizer

log = logging.getLogger("waferscale.api")
JSON_FORMATS = ("json_object", "json_schema")


def validate_chat_request(obj: dict) -> ChatCompletionRequest:
    """The request, or the hosted service's 400: every problem as `path: reason`, one per line."""
    try:
        return ChatCompletionRequest.model_validate(obj)
    except PydanticValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            path = ".".join(str(p) for p in e["loc"])
            reason = (
                f"property {e['loc'][-1]!r} is unsupported" if e["type"] == "extra_forbidden" else e["msg"]
            )
            lines.append(f"{path}: {reason}" if path else reason)
        raise APIError(400, "\n".join(lines), param="validation_error", code="wrong_api_format") from None


# ---------------------------------------------------------------- planning


@dataclass
class ChatPlan:
    """A validated chat request resolved against the model: the rendered prompt and how to read the output."""

    request: ChatCompletionRequest
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    top_logprobs: int | None  # None: no logprobs; k: the sampled token plus k alternatives
    tool_mode: str | None  # None (no call may be made), "auto", "required" or "named"
    syntax: tooling.ToolSyntax  # the model's tool-call syntax, chosen once from its template
    reasoning_format: str | None  # where reasoning goes, for templates that reason; None otherwise
    opens_reasoning: bool = False  # the generation prompt already opened <think>
    prediction_tokens: int = 0
    output: type = field(default=None)  # ChoiceOutput, or HarmonyOutput for a harmony template


def _text(content, param: str) -> str | None:
    """A message's content as text; parts are joined with newlines. Image parts: this model reads text only."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextContent):
            raise APIError(
                400,
                f"{param}.{j}: this model reads text only; remove the {part.type} part or serve a model that "
                "accepts images",
                param=f"{param}.{j}",
                code="unsupported_content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(raw: str):
    """Templates expect a call's arguments as a mapping; a string that is not a JSON object stays as sent."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


def conversation(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the template reads them (OpenAI's shape, content as text, arguments as mappings).

    An assistant's `reasoning` reaches the template as `reasoning_content`; with clear_thinking, only for turns
    after the latest user message."""
    messages = [m.root for m in req.messages]
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        param = f"messages.{i}.content"
        item: dict = {"role": m.role, "content": _text(m.content, param)}
        if m.name is not None:
            item["name"] = m.name
        if m.role == "assistant":
            if m.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            reasoning = _text(m.reasoning, f"messages.{i}.reasoning")
            if reasoning and not (req.clear_thinking and i < last_user):
                item["reasoning_content"] = reasoning
        if m.role == "tool":
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _context_message(length: int, limit: int) -> str:
    return (
        "Please reduce the length of the messages or completion. "
        f"Current length is {length} while limit is {limit}"
    )


@functools.lru_cache(maxsize=4)
def _special_tokens(tok: ModelTokenizer) -> frozenset[str]:
    return tooling.grammar_special_tokens(tok.tokenizer)


def plan_chat(req: ChatCompletionRequest, ctx: ServingContext) -> ChatPlan:
    """Check everything that needs the model, render the conversation and resolve the sampling parameters."""
    check_model(req.model, ctx)
    template: ChatTemplate = ctx.chat_template
    if req.model_parameters:
        raise APIError(
            400,
            f"model_parameters: {req.model} declares no model parameters; remove "
            f"{', '.join(sorted(req.model_parameters))}",
            param="model_parameters",
        )
    n = req.n or 1
    if n > MAX_SEQUENCES:
        raise APIError(400, f"n is {n}; the limit is {MAX_SEQUENCES}", param="n")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    messages = conversation(req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    tooling.validate_conversation(  # the wire form: arguments still JSON strings
        [m.root.model_dump(exclude_none=True) for m in req.messages], tools or None, choice
    )
    choice = choice if choice is not None else ("auto" if tools else "none")
    tool_mode = None
    if tools and choice != "none":
        tool_mode = choice if isinstance(choice, str) else "named"
    fmt = req.response_format.model_dump(by_alias=True) if req.response_format is not None else None
    json_format = fmt is not None and fmt["type"] in JSON_FORMATS
    reasoning_format = None
    if template.reasoning:
        reasoning_format = req.reasoning_format.value
        if reasoning_format == "none" and template.harmony:
            reasoning_format = "text_parsed"  # gpt-oss's default on the hosted service
        elif reasoning_format == "none":
            reasoning_format = "hidden" if json_format else "raw"  # Qwen3's defaults on the hosted service
        if reasoning_format == "raw" and json_format:
            raise APIError(
                400,
                "reasoning_format 'raw' cannot be combined with a JSON response_format; use parsed, text_parsed or "
                "hidden",
                param="reasoning_format",
            )
    prompt_text = render_prompt(req, template, messages, tools or None)
    # a conversation whose rendered prefix alone overflows the context is refused before it is tokenized in full
    # (the length reported is then what the prefix proved, a lower bound)
    known = prompt_overflows(
        ctx.tokenizer.tokenizer, prompt_text, ctx.max_model_len, add_special_tokens=False
    )
    if known is not None:
        raise APIError(
            400, _context_message(known, ctx.max_model_len), param="messages", code="context_length_exceeded"
        )
    prompt_ids = encode(ctx.tokenizer.tokenizer, prompt_text, add_special_tokens=False).ids
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    min_tokens = req.min_completion_tokens if req.min_completion_tokens is not None else req.min_tokens
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit, least = token_limits(
        len(prompt_ids),
        max_tokens,
        min_tokens,
        ctx,
        max_param=max_param,
        prompt_param="messages",  # chat has no `prompt`: the messages are what is too long
        too_long=_context_message,
    )
    syntax = tooling.syntax(template.tool_syntax)
    special = _special_tokens(ctx.tokenizer)
    grammar = tooling.format_grammar(fmt, syntax, special)
    if tool_mode is not None or (tools and choice == "none"):
        grammar = tooling.tool_grammar(
            tools,
            choice,
            req.parallel_tool_calls is not False,
            syntax,
            special_tokens=special,
            response_format=fmt,
        )
    prediction: list[int] = []
    if req.prediction is not None:
        predicted = _text(req.prediction.content, "prediction.content") or ""
        prediction = encode(ctx.tokenizer.tokenizer, predicted, add_special_tokens=False).ids
    params = sampling_params(
        req,
        ctx,
        max_tokens=limit,
        min_tokens=least,
        stop=stop_list(req.stop) + ([RETURN, CALL] if template.harmony else []),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        lark=grammar,
        prediction=prediction or None,
        skip_special_tokens=not template.harmony,  # harmony's channels are special tokens the parser reads
    )
    return ChatPlan(
        req,
        prompt_text,
        prompt_ids,
        params,
        n,
        (req.top_logprobs or 0) if req.logprobs else None,
        tool_mode,
        syntax,
        reasoning_format,
        not template.harmony and reasoning_format is not None and prompt_opens_reasoning(prompt_text),
        len(prediction),
        HarmonyOutput if template.harmony else ChoiceOutput,
    )


def render_prompt(
    req: ChatCompletionRequest,
    template: ChatTemplate,
    messages: list[dict],
    tools: list[dict] | None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation (`conversation(req)`) through the model's template with the request's reasoning controls:
    gpt-oss's effort line, or Qwen3-style thinking switched off; a template's refusal is a 400."""
    thinking, effort = None, None
    if template.harmony:
        effort = harmony_effort(req)
    elif template.reasoning and (
        req.disable_reasoning or (req.reasoning_effort and req.reasoning_effort.value == "none")
    ):
        thinking = False
    try:
        return template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=thinking,
            reasoning_effort=effort,
        )
    except TemplateError as exc:
        raise APIError(400, f"messages: {exc}", param="messages") from None


def harmony_effort(req: ChatCompletionRequest) -> str | None:
    """The `Reasoning:` level of gpt-oss's system message: low, medium or high as asked; None leaves the template's
    default (medium). gpt-oss always reasons (it calls tools from its reasoning): `reasoning_effort: "none"` and
    `disable_reasoning` get the default effort rather than switching reasoning off (docs/api.md)."""
    effort = req.reasoning_effort.value if req.reasoning_effort is not None else None
    return "medium" if effort == "none" else effort


# ---------------------------------------------------------------- output


def logprob_entries(entries: list[TokenLogprob], k: int, tok: ModelTokenizer) -> list[dict]:
    """The chat shape: one object per token, its k alternatives sorted, each with its own bytes."""
    return [
        {
            "token": e.text,
            "logprob": e.logprob,
            "bytes": token_bytes(tok, e.token_id, e.text),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": token_bytes(tok, i, t)}
                for i, t, v in sorted(e.top or [], key=lambda item: item[2], reverse=True)[:k]
            ],
        }
        for e in entries
    ]


@dataclass
class ChoiceOutput:
    """One choice's output as the client sees it: content, reasoning and tool calls, built event by event."""

    plan: ChatPlan
    content: str = ""  # content sent (or to send) to the client
    reasoning: str = ""
    answer: str = ""  # every piece of content generated, for tool-call parsing
    held: str = ""  # content held back while it may still be the start of a tool call
    calling: bool = False
    reasoning_tokens: int = 0
    splitter: ReasoningSplitter | None = None
    content_logprobs: list[dict] = field(default_factory=list)
    reasoning_logprobs: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plan.reasoning_format is not None:
            self.splitter = ReasoningSplitter(in_reasoning=self.plan.opens_reasoning)
        self.calling = self.plan.tool_mode in ("required", "named")

    def add(self, ev: GenerationEvent, tok: ModelTokenizer) -> dict:
        """The delta this event adds: {'content'?, 'reasoning'?, 'logprobs'?, 'reasoning_logprobs'?}."""
        fmt = self.plan.reasoning_format
        reasoning, content = self.splitter.feed(ev.text) if self.splitter else ("", ev.text)
        if ev.finished and self.splitter:
            r, c = self.splitter.finish()
            reasoning, content = reasoning + r, content + c
        thinking = bool(reasoning) and not content  # this event's tokens are reasoning tokens
        if thinking:
            self.reasoning_tokens += len(ev.token_ids)
        if fmt == "raw":  # reasoning stays in the content, tags and all, as generated
            opened = "<think>" if self.plan.opens_reasoning and not (self.answer or self.content) else ""
            reasoning, content = "", opened + ev.text
        delta: dict = {}
        if reasoning and fmt in ("parsed", "text_parsed"):
            self.reasoning += reasoning
            delta["reasoning"] = reasoning
        if self.plan.top_logprobs is not None and ev.logprobs and not (thinking and fmt == "hidden"):
            entries = logprob_entries(ev.logprobs, self.plan.top_logprobs, tok)
            if thinking and fmt == "parsed":
                self.reasoning_logprobs += entries
                delta["reasoning_logprobs"] = entries
            else:
                self.content_logprobs += entries
                delta["logprobs"] = entries
        self.answer += content
        content = self._release(content, ev.finished)
        if content:
            self.content += content
            delta["content"] = content
        return delta

    def _release(self, content: str, finished: bool) -> str:
        """Content the client may see now. With tools, text that may begin a call is held until it is known: a
        hermes call may follow some text (what precedes it is content); a llama3_json call is the whole output."""
        if self.plan.tool_mode is None or self.calling:
            return "" if self.calling else content
        self.held += content
        prefix = self.plan.syntax.call_prefix
        if self.plan.syntax.name == "llama3_json":
            start = self.held.lstrip()
            if start.startswith(prefix):
                self.calling, self.held = True, ""
                return ""
            if not finished and not start:
                return ""
            out, self.held = self.held, ""
            return out
        at = self.held.find(prefix)
        if at >= 0:
            self.calling, out, self.held = True, self.held[:at], ""
            return out
        keep = (
            0
            if finished
            else next((k for k in range(len(prefix) - 1, 0, -1) if self.held.endswith(prefix[:k])), 0)
        )
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[list[dict], str]:
        """At the end: the calls made (each with a fresh id) and content not yet sent (a call cut short by the
        token limit goes out as text)."""
        if not self.calling:
            return [], ""
        content, calls = self.plan.syntax.parse(self.answer)
        if not calls:
            self.calling, late = False, self.answer[len(self.content) :]
            self.content = self.answer
            return [], late
        prefix = self.plan.syntax.call_prefix
        if (
            content and self.plan.syntax.name == "hermes" and prefix in content
        ):  # a further call cut short by the limit
            content = content[: content.index(prefix)].strip()
        self.content = content or ""
        made = [
            {
                "id": tooling.new_tool_call_id(),
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
        return made, ""


class ChatRun:
    """Runs a chat plan on the engine and renders the ChatCompletionResponse or the stream of chunks."""

    def __init__(self, plan: ChatPlan, ctx: ServingContext, fail_after: int | None = None):
        self.plan, self.ctx = plan, ctx
        self.run = Run(ctx, "chatcmpl", [plan.prompt_ids], [plan.params], plan.n, fail_after)
        self.outputs = [plan.output(plan) for _ in range(plan.n)]

    def _header(self, obj: str) -> dict:
        return {
            "id": self.run.id,
            "object": obj,
            "created": self.run.created,
            "model": self.plan.request.model,
            "system_fingerprint": self.ctx.fingerprint,
        }

    def _usage(self) -> dict:
        events = [s.last for s in self.run.seqs if s.last is not None]
        details = {
            "reasoning_tokens": sum(o.reasoning_tokens for o in self.outputs),
            "accepted_prediction_tokens": sum(e.accepted_prediction_tokens for e in events),
            "rejected_prediction_tokens": sum(e.rejected_prediction_tokens for e in events),
        }
        return self.run.usage(details)

    def _finish_reason(self, k: int, calls: list[dict]) -> str:
        return "tool_calls" if calls else self.run.seqs[k].finish_reason or "stop"

    def _tier(self) -> dict:
        tier = self.plan.request.service_tier
        return {"service_tier_used": "default"} if tier is not None and tier.value == "auto" else {}

    async def collect(self, is_disconnected) -> dict:
        """Run every choice to its end and build the ChatCompletionResponse."""
        await self.run.collect(is_disconnected)
        choices = []
        for k, (seq, out) in enumerate(zip(self.run.seqs, self.outputs)):
            whole = GenerationEvent(
                "", text=seq.text, token_ids=seq.token_ids, logprobs=seq.logprobs, finished=True
            )
            out.add(whole, self.ctx.tokenizer)
            calls, _ = out.finish()
            message: dict = {
                "role": "assistant",
                "content": out.content if (out.content or not calls) else None,
            }
            if out.reasoning and self.plan.reasoning_format in ("parsed", "text_parsed"):
                message["reasoning"] = out.reasoning
            if calls:
                message["tool_calls"] = calls
            choice: dict = {"index": k, "message": message, "finish_reason": self._finish_reason(k, calls)}
            if self.plan.top_logprobs is not None:
                choice["logprobs"] = {"content": out.content_logprobs}
                if self.plan.reasoning_format == "parsed":
                    choice["reasoning_logprobs"] = {"content": out.reasoning_logprobs}
            choices.append(choice)
        self._log([c["message"] for c in choices])
        return {
            **self._header("chat.completion"),
            "choices": choices,
            "usage": self._usage(),
            "time_info": self.run.time_info(),
            **self._tier(),
        }

    def _log(self, outputs: list) -> None:
        if self.ctx.log_requests:  # prompts and outputs are private unless the operator asks
            log.info("%s prompt=%r outputs=%r", self.run.id, self.plan.prompt_text, outputs)

    def _chunk(self, choice: dict) -> dict:
        return {**self._header("chat.completion.chunk"), "choices": [choice]}

    async def stream(self) -> AsyncIterator[str]:
        """SSE lines in the hosted service's order: a role-only chunk per choice, content (and reasoning) deltas,
        a choice's tool calls whole in one chunk, its finish chunk; the last finish chunk carries usage and
        time_info; then [DONE]. A failure after the start is an error chunk."""
        for k in range(self.plan.n):
            yield sse(self._chunk({"index": k, "delta": {"role": "assistant"}}))
        remaining = self.plan.n
        async for k, ev in self.run.events():
            if ev.error:
                yield sse(engine_error(ev.error).body())
                yield SSE_DONE
                return
            out = self.outputs[k]
            delta = out.add(ev, self.ctx.tokenizer)
            body = {key: delta[key] for key in ("content", "reasoning") if key in delta}
            if body or "logprobs" in delta or "reasoning_logprobs" in delta:
                choice: dict = {"index": k, "delta": body}
                for key in ("logprobs", "reasoning_logprobs"):
                    if key in delta:
                        choice[key] = {"content": delta[key]}
                yield sse(self._chunk(choice))
            if not ev.finished:
                continue
            remaining -= 1
            calls, late = out.finish()
            if late:
                yield sse(self._chunk({"index": k, "delta": {"content": late}}))
            if calls:
                numbered = [{"index": i, **c} for i, c in enumerate(calls)]
                yield sse(self._chunk({"index": k, "delta": {"tool_calls": numbered}}))
            final = self._chunk({"index": k, "delta": {}, "finish_reason": self._finish_reason(k, calls)})
            if remaining == 0:
                final.update(usage=self._usage(), time_info=self.run.time_info(), **self._tier())
            yield sse(final)
        self._log([o.content for o in self.outputs])
        yield SSE_DONE
