"""POST /v1/completions: validated request -> engine sequences -> a response or an SSE stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import ValidationError as PydanticValidationError

from waferscale.api.errors import APIError, engine_error
from waferscale.api.schemas import CompletionRequest
from waferscale.engine import (
    AsyncEngine,
    ErrorKind,
    GenerationEvent,
    RequestError,
    SamplingParams,
    TokenLogprob,
)
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.grammar import open_json_suffix
from waferscale.models.tokenizer import ModelTokenizer

log = logging.getLogger("waferscale.api")
MAX_PROMPTS = 64
MAX_SEQUENCES = 128  # prompts x best_of in one request


@dataclass
class ServingContext:
    """What the HTTP layer needs to know about the served model."""

    engine: AsyncEngine
    tokenizer: ModelTokenizer
    served_names: list[str]
    max_model_len: int
    vocab_size: int
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    log_requests: bool = False
    fault_injection: bool = False  # honour X-Waferscale-Fault-After (testing aid, off unless asked for)
    max_waiting: int | None = None  # sequences allowed to wait for admission; beyond it, 429
    rejected: int = 0  # requests turned away with 429
    draining: bool = False  # shutting down: no new requests


def check_capacity(plan: Plan, ctx: ServingContext) -> None:
    """429 with Retry-After when the waiting queue is full (a request that alone exceeds it waits for an empty
    queue, so it is never refused forever)."""
    if ctx.draining:
        raise APIError(
            503, "the server is shutting down; retry against another instance", code="shutting_down"
        )
    if ctx.max_waiting is None:
        return
    waiting = ctx.engine.num_waiting()
    new = len(plan.prompts) * plan.best_of
    if waiting and waiting + new > ctx.max_waiting:
        ctx.rejected += 1
        raise APIError(
            429,
            f"the server is at capacity ({waiting} sequences waiting, limit {ctx.max_waiting}); retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


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
    if req.model not in ctx.served_names:
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves: {', '.join(ctx.served_names)}",
            param="model",
            code="model_not_found",
        )
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
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logit_bias = _logit_bias(req, ctx)
    params = []
    for p in prompts:
        room = ctx.max_model_len - len(p.ids)
        if room <= 0:
            raise APIError(
                400,
                f"prompt is {len(p.ids)} tokens; the model's context length is {ctx.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = room if req.max_tokens in (None, -1) else req.max_tokens
        if max_tokens > room:
            raise APIError(
                400,
                f"prompt ({len(p.ids)} tokens) plus max_tokens ({max_tokens}) is {len(p.ids) + max_tokens}, over the "
                f"model's context length of {ctx.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        min_tokens = room if req.min_tokens == -1 else (req.min_tokens or 0)
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                min_tokens=min(min_tokens, max_tokens),
                stop=stop,
                logprobs=req.logprobs,
                prompt_logprobs=echo and req.logprobs is not None,
                frequency_penalty=req.frequency_penalty or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                logit_bias=logit_bias,
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
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:  # JSON can carry lone surrogates; no tokenizer can
                raise APIError(
                    400, "prompt is not valid Unicode (it holds a lone surrogate)", param="prompt"
                ) from None
            ids, offsets = tok.encode_with_offsets(item)
            prompts.append(Prompt(item, ids, offsets))
            continue
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


def _logit_bias(req: CompletionRequest, ctx: ServingContext) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < ctx.vocab_size:
            raise APIError(
                400,
                f"logit_bias key {key!r} is not a token id of this model (0..{ctx.vocab_size - 1})",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise APIError(
                400, f"logit_bias value {value} for token {key} is outside -100..100", param="logit_bias"
            )
        out[token] = float(value)
    return out


def prompt_offsets(prompt: Prompt, tok: ModelTokenizer) -> list[int]:
    """Character offset of each prompt token (token-id prompts are decoded incrementally)."""
    if prompt.offsets is None:
        detok = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
        for t in prompt.ids:
            detok.add(t)
        prompt.offsets = detok.offsets
    return prompt.offsets


# ---------------------------------------------------------------- formatting


def logprobs_block(entries: list[TokenLogprob], base: int, k: int) -> dict:
    """CompletionLogProbs for these entries; `base` is the character offset their text starts at."""
    tops = None
    if k > 0:
        tops = []
        for e in entries:
            if e.top is None:
                tops.append(None)
                continue
            top = dict(e.top)
            if e.text not in top and e.logprob is not None:
                top[e.text] = e.logprob  # the sampled token always appears
            tops.append(top)
    return {
        "text_offset": [base + e.offset for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.text for e in entries],
        "top_logprobs": tops,
    }


def with_prompt_offsets(
    prompt: Prompt, entries: list[TokenLogprob], tok: ModelTokenizer
) -> list[TokenLogprob]:
    for e, off in zip(entries, prompt_offsets(prompt, tok)):
        e.offset = off
    return entries


@dataclass
class Choice:
    index: int
    prompt: Prompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    generated: int = 0
    cumulative: float = 0.0
    error: RequestError | None = None
    last: GenerationEvent | None = None

    def absorb(self, ev: GenerationEvent) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
        self.logprobs += ev.logprobs
        if ev.prompt_logprobs:
            self.prompt_logprobs = ev.prompt_logprobs
        self.generated = ev.num_generated_tokens
        self.cumulative = ev.cumulative_logprob
        if ev.finished:
            self.finish_reason, self.error, self.last = ev.finish_reason, ev.error, ev


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
        block = logprobs_block(entries, len(prompt.text), k)
        if plan.echo and first and prompt_entries:
            pre = logprobs_block(with_prompt_offsets(prompt, prompt_entries, ctx.tokenizer), 0, k)
            block = {key: None if pre[key] is None else pre[key] + block[key] for key in block}
        body["logprobs"] = block
    if plan.raw_tokens:
        body["tokens"] = list(token_ids)
    return body


# ---------------------------------------------------------------- running


class CompletionRun:
    """Runs a plan on the engine and renders the response or the stream."""

    def __init__(self, plan: Plan, ctx: ServingContext, fail_after: int | None = None):
        self.plan, self.ctx, self.fail_after = plan, ctx, fail_after
        self.id = f"cmpl-{uuid.uuid4()}"
        self.started = time.perf_counter()
        self.choices: list[Choice] = []
        for i, prompt in enumerate(plan.prompts):
            for j in range(plan.best_of):
                self.choices.append(Choice(index=i * plan.n + j, prompt=prompt))

    def _generate(self, k: int) -> AsyncIterator[GenerationEvent]:
        c = self.choices[k]
        params = self.plan.params[k // self.plan.best_of]
        if params.seed is not None:  # each candidate of a prompt draws its own stream: seed, seed+1, ...
            params = dataclasses.replace(params, seed=params.seed + k % self.plan.best_of)
        if self.fail_after is not None:
            self.ctx.engine.inject_fault(f"{self.id}-{k}", self.fail_after)
        return self.ctx.engine.generate(f"{self.id}-{k}", c.prompt.ids, params)

    def _header(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.plan.request.model,
            "system_fingerprint": self.ctx.fingerprint,
        }

    def _usage(self) -> dict:
        prompt_tokens = sum(len(p.ids) for p in self.plan.prompts)
        completion = sum(c.generated for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens()},
        }

    def _cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, once per prompt (its n/best_of candidates share them)."""
        per_prompt: dict[int, int] = {}
        for k, c in enumerate(self.choices):
            if c.last is not None:
                i = k // self.plan.best_of
                per_prompt[i] = max(per_prompt.get(i, 0), min(c.last.num_cached_tokens, len(c.prompt.ids)))
        return sum(per_prompt.values())

    def _time_info(self) -> dict:
        total = time.perf_counter() - self.started
        lasts = [c.last for c in self.choices if c.last is not None]
        queue = min((e.queue_time for e in lasts), default=0.0)
        prompt = max((e.prompt_time for e in lasts), default=0.0)
        return {
            "queue_time": queue,
            "prompt_time": prompt,
            "completion_time": max(0.0, total - queue - prompt),
            "total_time": total,
            "created": time.time(),
        }

    async def collect(self, is_disconnected) -> dict:
        """Run every sequence to the end and build the CompletionResponse."""

        async def run(k: int) -> None:
            async for ev in self._generate(k):
                self.choices[k].absorb(ev)

        tasks = [asyncio.create_task(run(k)) for k in range(len(self.choices))]
        watcher = asyncio.create_task(_watch(is_disconnected, tasks))
        try:
            await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
        failed = next((c for c in self.choices if c.error), None)
        if failed is not None:
            raise engine_error(failed.error)
        picked = self._pick_best()
        self._log_texts([c.text for _, c in picked])
        choices = [
            choice_body(
                self.plan,
                self.ctx,
                idx,
                c.prompt,
                c.text,
                c.token_ids,
                c.logprobs,
                c.prompt_logprobs,
                c.finish_reason,
                True,
            )
            for idx, c in picked
        ]
        return {**self._header(), "choices": choices, "usage": self._usage(), "time_info": self._time_info()}

    def _log_texts(self, outputs: list[str]) -> None:
        if self.ctx.log_requests:  # prompts and outputs are private unless the operator asks
            log.info("%s prompts=%r outputs=%r", self.id, [p.text for p in self.plan.prompts], outputs)

    def _pick_best(self) -> list[tuple[int, Choice]]:
        """With best_of > n, the n candidates of each prompt with the highest mean token logprob."""
        plan = self.plan
        if plan.best_of == plan.n:
            return [(c.index, c) for c in self.choices]
        out = []
        for i in range(len(plan.prompts)):
            cands = self.choices[i * plan.best_of : (i + 1) * plan.best_of]
            ranked = sorted(cands, key=lambda c: c.cumulative / max(1, c.generated), reverse=True)[: plan.n]
            out.extend((i * plan.n + r, c) for r, c in enumerate(ranked))
        return out

    async def start_stream(self) -> AsyncIterator[str]:
        """Wait until every sequence is admitted and has its first event, then return the SSE body; a sequence
        refused before that (overloaded, invalid, unavailable) raises its APIError, so the client gets a real status."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(k: int) -> None:
            try:
                async for ev in self._generate(k):
                    await queue.put((k, ev))
            except Exception as exc:  # surfaced to the client as an error chunk
                log.exception("stream failed")
                error = RequestError(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}")
                await queue.put((k, GenerationEvent("", finished=True, error=error)))

        tasks = [asyncio.create_task(run(k)) for k in range(len(self.choices))]
        early: list = []
        try:
            heard: set[int] = set()
            while len(heard) < len(self.choices):
                k, ev = await queue.get()
                if ev.error:
                    raise engine_error(ev.error)
                heard.add(k)
                early.append((k, ev))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        return self._stream(queue, tasks, early)

    async def _stream(self, queue: asyncio.Queue, tasks: list[asyncio.Task], early: list) -> AsyncIterator[str]:
        """SSE lines: completion chunks as tokens arrive, optional usage chunk, then [DONE]."""
        include_usage = bool(
            self.plan.request.stream_options and self.plan.request.stream_options.include_usage
        )
        started = [False] * len(self.choices)
        remaining = len(self.choices)
        try:
            while remaining:
                k, ev = early.pop(0) if early else await queue.get()
                c = self.choices[k]
                c.absorb(ev)
                if ev.error:
                    yield _sse(engine_error(ev.error).body())
                    yield "data: [DONE]\n\n"
                    return
                if ev.finished:
                    remaining -= 1
                if not (ev.text or ev.token_ids or ev.finished or (self.plan.echo and not started[k])):
                    continue
                chunk = self._header()
                chunk["choices"] = [
                    choice_body(
                        self.plan,
                        self.ctx,
                        c.index,
                        c.prompt,
                        ev.text,
                        ev.token_ids,
                        ev.logprobs,
                        ev.prompt_logprobs,
                        ev.finish_reason if ev.finished else None,
                        not started[k],
                    )
                ]
                started[k] = True
                if remaining == 0 and not include_usage:
                    chunk["time_info"] = self._time_info()
                yield _sse(chunk)
            self._log_texts([c.text for c in self.choices])
            if include_usage:
                yield _sse(
                    {**self._header(), "choices": [], "usage": self._usage(), "time_info": self._time_info()}
                )
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()


async def _watch(is_disconnected, tasks: list[asyncio.Task]) -> None:
    """Cancel the sequences of a non-streaming request whose client went away."""
    while True:
        await asyncio.sleep(0.2)
        if await is_disconnected():
            for t in tasks:
                t.cancel()
            return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def validate_request(obj: dict) -> CompletionRequest:
    """CompletionRequest from a decoded body; pydantic errors re-raised as FastAPI's 422 (loc under 'body')."""
    from fastapi.exceptions import RequestValidationError

    try:
        return CompletionRequest.model_validate(obj)
    except PydanticValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
