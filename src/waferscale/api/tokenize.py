"""POST /v1/tokenize and /v1/detokenize (waferscale's extension; vLLM's shape, also at /tokenize, /detokenize):
a prompt, token ids, or chat messages rendered through the model's template, so a client can budget tokens as the
server will count them."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError
from starlette.concurrency import run_in_threadpool

from waferscale.api.chat import conversation, render_prompt, validate_chat_request
from waferscale.api.errors import APIError
from waferscale.api.models_registry import ModelRegistry
from waferscale.api.pipeline import ServingContext, check_model


class TokenizeRequest(BaseModel):
    """Either `prompt` (text, tokenized as completions tokenize it) or `messages` (a chat, as chat completions
    render and tokenize it)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool = True  # prompt only: the BOS the model's tokenizer adds
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening
    reasoning_effort: str | None = None  # messages only: as chat completions take it (gpt-oss's effort line)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


def _validated(cls: type[BaseModel], obj: dict) -> BaseModel:
    """The request, or a 400 naming every problem as `path: reason`."""
    try:
        return cls.model_validate(obj)
    except PydanticValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)]
        raise APIError(400, "\n".join(lines), param="validation_error", code="wrong_api_format") from None


def tokenize(req: TokenizeRequest, ctx: ServingContext) -> dict:
    """Token ids of a prompt or a rendered chat, with the count and the context length."""
    check_model(req.model, ctx)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt")
    tok = ctx.tokenizer
    if req.prompt is not None:
        ids = tok.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids
    else:
        body = {"model": req.model, "messages": req.messages, "tools": req.tools}
        if req.reasoning_effort is not None:
            body["reasoning_effort"] = req.reasoning_effort
        chat = validate_chat_request(body)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        text = render_prompt(chat, ctx.chat_template, conversation(chat), tools, req.add_generation_prompt)
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(req: DetokenizeRequest, ctx: ServingContext) -> dict:
    """The text of token ids (special tokens kept, as the model sees them)."""
    check_model(req.model, ctx)
    bad = [t for t in req.tokens if t >= ctx.tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (0..{ctx.tokenizer.vocab_size - 1})",
                       param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def add_tokenize_routes(app: FastAPI, models: ModelRegistry, auth, read_body) -> None:
    """Register the two endpoints (under /v1 and, as vLLM serves them, at the root); the request's model is
    loaded if it is not."""

    async def tokenize_route(request: Request) -> dict:
        req = _validated(TokenizeRequest, await read_body(request))
        async with models.lease(req.model) as lease:
            return await run_in_threadpool(tokenize, req, lease.ctx)

    async def detokenize_route(request: Request) -> dict:
        req = _validated(DetokenizeRequest, await read_body(request))
        async with models.lease(req.model) as lease:
            return await run_in_threadpool(detokenize, req, lease.ctx)

    for prefix in ("/v1", ""):
        for path, route, schema in (("tokenize", tokenize_route, TokenizeRequest),
                                    ("detokenize", detokenize_route, DetokenizeRequest)):
            body = {"required": True, "content": {"application/json": {"schema": schema.model_json_schema()}}}
            app.add_api_route(
                f"{prefix}/{path}", route, methods=["POST"], tags=["Tokens"], dependencies=[Depends(auth)],
                include_in_schema=False, openapi_extra={"requestBody": body},
                summary=f"{path.capitalize()} (waferscale's extension)",
            )
