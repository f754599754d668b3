"""POST /v1/completions: validated request -> engine sequences -> a response or an SSE stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import ValidationError as PydanticValidationError

from waferscale.api.errors import APIError, engine_error
from waferscale.api.pipeline import (
    MAX_SEQUENCES,
    SSE_DONE,
    Run,
    ServingContext,
    check_model,
    encode,
    prompt_overflows,
    resolve_logit_bias,
    sampling_params,
    sse,
    stop_list,
    token_limits,
)
from waferscale.api.pipeline import Sequence as PipelineSequence
from waferscale.api.schemas import CompletionRequest
from waferscale.api.tokens import token_name, top_named
from waferscale.engine import SamplingParams, TokenLogprob
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.grammar import open_json_suffix
from waferscale.models.tokenizer import ModelTokenizer

log = logging.getLogger("waferscale.api")
MAX_PROMPTS = 64


@dataclass
class Prompt:
    text: str
    ids: list[int]
    offsets: list[int] | None  # character offset of each prompt token in `text` (computed when needed)


@dataclass
class Plan:
    """A validated request, resolved into prompts and per-prompt sampling parameters."""

    request: CompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    best_of: int
    logprobs: int | None
    echo: bool
    raw_tokens: bool


# ---------------------------------------------------------------- planning


def plan_request(req: CompletionRequest, ctx: ServingContext) -> Plan:
    """Check everything that needs the model (names, lengths, token ids) and resolve defaults."""
    check_model(req.model, ctx)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    echo, raw_tokens = bool(req.echo), bool(req.return_raw_tokens)
    if echo and raw_tokens:
        raise APIError(400, "echo is incompatible with return_raw_tokens", param="echo")
    n = req.n or 1
    # best_of defaults to 1 in the schema; unset (or null/0) means "as many as n"
    best_of = (req.best_of if "best_of" in req.model_fields_set else None) or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must not be less than n ({n})", param="best_of")
    if best_of > n and req.stream:
        raise APIError(400, "best_of greater than n cannot be streamed", param="best_of")
    prompts = _prompts(req, ctx)
    if req.grammar_root == "insidevalue":
        for p in prompts:
            if open_json_suffix(p.text) is None:
                raise APIError(
                    400,
                    "grammar_root 'insidevalue' continues a JSON object or array that the prompt opens and leaves "
                    'unclosed; end the prompt inside one, for example with \'{"name": "Ada", \'',
                    param="grammar_root",
                )
    if len(prompts) * best_of > MAX_SEQUENCES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x {best_of} candidates = {len(prompts) * best_of} sequences; the limit is "
            f"{MAX_SEQUENCES}",
            param="n",
        )
    stop = stop_list(req.stop)
    logit_bias = resolve_logit_bias(req.logit_bias, ctx)
    params = []
    for p in prompts:
        max_tokens, min_tokens = token_limits(
            len(p.ids), req.max_tokens, req.min_tokens, ctx, max_param="max_tokens"
        )
        params.append(
            sampling_params(
                req,
                ctx,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                stop=stop,
                logprobs=req.logprobs,
                logit_bias=logit_bias,
                prompt_logprobs=echo and req.logprobs is not None,
                grammar=req.grammar_root,
            )
        )
    return Plan(req, prompts, params, n, best_of, req.logprobs, echo, raw_tokens)


def _prompts(req: CompletionRequest, ctx: ServingContext) -> list[Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise APIError(400, "prompt is an empty list; send at least one prompt", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise APIError(
            400, f"{len(items)} prompts in one request; the limit is {MAX_PROMPTS}", param="prompt"
        )
    tok = ctx.tokenizer
    prompts = []
    for item in items:
        if isinstance(item, str):
            # a prompt whose prefix alone overflows the context is refused before it is tokenized in full (or
            # scanned whole for lone surrogates, 0.1 s of the GIL for 30 MiB)
            try:
                known = prompt_overflows(tok.tokenizer, item, ctx.max_model_len, add_special_tokens=True)
            except (UnicodeEncodeError, TypeError):  # a lone surrogate in the prefix: refused just below
                known = None
            if known is not None:
                raise APIError(
                    400,
                    f"prompt is at least {known} tokens; the model's context length is {ctx.max_model_len}",
                    param="prompt",
                    code="context_length_exceeded",
                )
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # JSON can carry lone surrogates; no tokenizer can
                raise APIError(
                    400, "prompt is not valid Unicode (it holds a lone surrogate)", param="prompt"
                ) from None
            enc = encode(
                tok.tokenizer, item, add_special_tokens=True
            )  # as tok.encode_with_offsets, off the GIL
            prompts.append(Prompt(item, enc.ids, [start for start, _ in enc.offsets]))
            continue
        if len(item) >= ctx.max_model_len:  # refused before the ids are checked or decoded
            raise APIError(
                400,
                f"prompt is {len(item)} tokens; the model's context length is {ctx.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = [t for t in item if t >= ctx.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is out of range; this model's vocabulary is 0..{ctx.vocab_size - 1}",
                param="prompt",
            )
        prompts.append(Prompt(tok.decode(item, skip_special_tokens=False), list(item), None))
    for p in prompts:
        if not p.ids:  # an empty prompt is conditioned on the start (or end) of text, as OpenAI does
            start = tok.info.bos_token_id if tok.info.bos_token_id is not None else tok.eos_token_ids[0]
            p.ids, p.offsets = [start], [0]
    return prompts


def prompt_offsets(prompt: Prompt, tok: ModelTokenizer) -> list[int]:
    """Character offset of each prompt token (token-id prompts are decoded incrementally)."""
    if prompt.offsets is None:
        detok = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
        for t in prompt.ids:
            detok.add(t)
        prompt.offsets = detok.offsets
    return prompt.offsets


# ---------------------------------------------------------------- formatting


def logprobs_block(entries: list[TokenLogprob], base: int, k: int, tok: ModelTokenizer) -> dict:
    """CompletionLogProbs for these entries; `base` is the character offset their text starts at. Tokens are named
    as OpenAI names them (`bytes:\\xNN...` for one that is not whole UTF-8 text), in `tokens` and as
    `top_logprobs` keys alike, so keys stay distinct and the sampled token is found under its own name."""
    names = [token_name(tok, e.token_id, e.text) for e in entries]
    tops = None
    if k > 0:
        tops = []
        for e, name in zip(entries, names):
            if e.top is None:
                tops.append(None)
                continue
            top = top_named(tok, e.top)
            if name not in top and e.logprob is not None:
                top[name] = e.logprob  # the sampled token always appears
            tops.append(top)
    return {
        "text_offset": [base + e.offset for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "tokens": names,
        "top_logprobs": tops,
    }


def with_prompt_offsets(
    prompt: Prompt, entries: list[TokenLogprob], tok: ModelTokenizer
) -> list[TokenLogprob]:
    for e, off in zip(entries, prompt_offsets(prompt, tok)):
        e.offset = off
    return entries


def choice_body(
    plan: Plan,
    ctx: ServingContext,
    index: int,
    prompt: Prompt,
    ev_text: str,
    token_ids,
    entries,
    prompt_entries,
    finish_reason,
    first: bool,
) -> dict:
    """One CompletionChoice; `first` marks the chunk that carries the echoed prompt."""
    text = ev_text
    if plan.echo and first:
        text = prompt.text + text
    body: dict = {
        "index": index,
        "text": text,
        "finish_reason": finish_reason,
        "logprobs": None,
        "tokens": None,
    }
    if plan.logprobs is not None:
        k = plan.logprobs
        block = logprobs_block(entries, len(prompt.text), k, ctx.tokenizer)
        if plan.echo and first and prompt_entries:
            pre = logprobs_block(
                with_prompt_offsets(prompt, prompt_entries, ctx.tokenizer), 0, k, ctx.tokenizer
            )
            block = {key: None if pre[key] is None else pre[key] + block[key] for key in block}
        body["logprobs"] = block
    if plan.raw_tokens:
        body["tokens"] = list(token_ids)
    return body


# ---------------------------------------------------------------- running


class CompletionRun:
    """Runs a plan on the engine and renders the CompletionResponse or the stream of chunks."""

    def __init__(self, plan: Plan, ctx: ServingContext, fail_after: int | None = None):
        self.plan, self.ctx = plan, ctx
        self.run = Run(ctx, "cmpl", [p.ids for p in plan.prompts], plan.params, plan.best_of, fail_after)

    def _choice_index(self, k: int) -> int:
        return (k // self.plan.best_of) * self.plan.n + k % self.plan.best_of

    def _header(self) -> dict:
        return {
            "id": self.run.id,
            "object": "text_completion",
            "created": self.run.created,
            "model": self.plan.request.model,
            "system_fingerprint": self.ctx.fingerprint,
        }

    def _body(
        self, index: int, seq: PipelineSequence, text, token_ids, entries, prompt_entries, finish, first
    ):
        prompt = self.plan.prompts[seq.prompt_index]
        return choice_body(
            self.plan, self.ctx, index, prompt, text, token_ids, entries, prompt_entries, finish, first
        )

    async def collect(self, is_disconnected) -> dict:
        """Run every sequence to the end and build the CompletionResponse."""
        await self.run.collect(is_disconnected)
        picked = self._pick_best()
        self._log_texts([s.text for _, s in picked])
        choices = [
            self._body(idx, s, s.text, s.token_ids, s.logprobs, s.prompt_logprobs, s.finish_reason, True)
            for idx, s in picked
        ]
        return {
            **self._header(),
            "choices": choices,
            "usage": self.run.usage(),
            "time_info": self.run.time_info(),
        }

    def _log_texts(self, outputs: list[str]) -> None:
        if self.ctx.log_requests:  # prompts and outputs are private unless the operator asks
            log.info("%s prompts=%r outputs=%r", self.run.id, [p.text for p in self.plan.prompts], outputs)

    def _pick_best(self) -> list[tuple[int, PipelineSequence]]:
        """With best_of > n, the n candidates of each prompt with the highest mean token logprob."""
        plan, seqs = self.plan, self.run.seqs
        if plan.best_of == plan.n:
            return [(self._choice_index(k), s) for k, s in enumerate(seqs)]
        out = []
        for i in range(len(plan.prompts)):
            cands = seqs[i * plan.best_of : (i + 1) * plan.best_of]
            ranked = sorted(cands, key=lambda s: s.cumulative / max(1, s.generated), reverse=True)[: plan.n]
            out.extend((i * plan.n + r, s) for r, s in enumerate(ranked))
        return out

    async def stream(self) -> AsyncIterator[str]:
        """SSE lines: completion chunks as tokens arrive; the chunk with the last finish_reason also carries usage
        and time_info (as the hosted service sends them); then [DONE]."""
        started = [False] * len(self.run.seqs)
        remaining = len(self.run.seqs)
        async for k, ev in self.run.events():
            if ev.error:
                yield sse(engine_error(ev.error).body())
                yield SSE_DONE
                return
            if ev.finished:
                remaining -= 1
            if not (ev.text or ev.token_ids or ev.finished or (self.plan.echo and not started[k])):
                continue
            seq = self.run.seqs[k]
            chunk = self._header()
            chunk["choices"] = [
                self._body(
                    self._choice_index(k),
                    seq,
                    ev.text,
                    ev.token_ids,
                    ev.logprobs,
                    ev.prompt_logprobs,
                    ev.finish_reason if ev.finished else None,
                    not started[k],
                )
            ]
            started[k] = True
            if remaining == 0:
                chunk["usage"], chunk["time_info"] = self.run.usage(), self.run.time_info()
            yield sse(chunk)
        self._log_texts([s.text for s in self.run.seqs])
        yield SSE_DONE


def validate_request(obj: dict) -> CompletionRequest:
    """CompletionRequest from a decoded body; pydantic errors re-raised as FastAPI's 422 (loc under 'body')."""
    from fastapi.exceptions import RequestValidationError

    try:
        return CompletionRequest.model_validate(obj)
    except PydanticValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
