"""The request pipeline both fronts share: the serving context, model and capacity checks, resolving lengths and
sampling controls, and running a request's sequences on the engine (collected whole, or merged into one stream of
events) with its usage and time accounting. `completions.py` and `chat.py` only plan and format."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from waferscale.api.errors import APIError, engine_error
from waferscale.engine import (
    ErrorKind,
    GenerationEvent,
    RequestError,
    SamplingParams,
    TokenLogprob,
)
from waferscale.engine.client import EngineClient
from waferscale.models.tokenizer import ModelTokenizer

log = logging.getLogger("waferscale.api")
MAX_SEQUENCES = 128  # prompts x candidates in one request


@dataclass
class ServingContext:
    """What the HTTP layer needs to know about the served model."""

    engine: EngineClient  # the local AsyncEngine, or replicas on Ray (scale/ray_client.py)
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
    chat_template: object | None = None  # models.chat_template.ChatTemplate, built once at start
    collectors: list = field(default_factory=list)  # more prometheus collectors for /metrics (per-replica series)


def unknown_model(name: str, served: list[str]) -> APIError:
    """The hosted service's 404 for a model not served here, listing the names that are."""
    return APIError(
        404,
        f"Model {name!r} does not exist or you do not have access to it; this server serves: {', '.join(served)}",
        param="model",
        code="model_not_found",
    )


def check_model(name: str, ctx: ServingContext) -> None:
    """404 in the hosted service's words when `name` is not served here."""
    if name not in ctx.served_names:
        raise unknown_model(name, ctx.served_names)


def shutting_down() -> APIError:
    """The 503 of a request that arrives once the server has begun to shut down."""
    return APIError(503, "the server is shutting down; retry against another instance", code="shutting_down")


def check_capacity(num_sequences: int, ctx: ServingContext) -> None:
    """429 with Retry-After when the waiting queue is full (a request that alone exceeds it waits for an empty
    queue, so it is never refused forever). A server shutting down refuses new requests before this, before they
    take their model's lease (server.py): a request that holds one is in flight and gets the grace period."""
    if ctx.max_waiting is None:
        return
    waiting = ctx.engine.num_waiting()
    if waiting and waiting + num_sequences > ctx.max_waiting:
        ctx.rejected += 1
        raise APIError(
            429,
            f"the server is at capacity ({waiting} sequences waiting, limit {ctx.max_waiting}); retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


def resolve_logit_bias(bias: dict[str, float] | None, ctx: ServingContext) -> dict[int, float]:
    """Token-id keys checked against the vocabulary and values against -100..100."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)  # string keys from JSON; msgpack may send integers (the schemas accept both)
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


LONG_TEXT = 100_000  # characters; longer texts (past any prompt that fits) are tokenized at idle priority


def _lower_priority() -> None:
    """SCHED_IDLE for this thread (Linux), else nice 19. A long tokenization at normal priority takes a core from
    the engine's OpenMP threads for tens of milliseconds; every parallel region of a decode step then waits at its
    barrier for the thread that lost its core, and the step stalls for hundreds of milliseconds. An idle-class
    thread runs only when a core would otherwise idle, and gives it back the moment the engine wakes."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        return
    except (AttributeError, OSError):
        pass
    try:  # a thread is a task with its own nice value (raising it needs no privilege)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


_background = concurrent.futures.ThreadPoolExecutor(
    max_workers=2, thread_name_prefix="tokenize-long", initializer=_lower_priority
)


def encode(tokenizer, text: str, *, add_special_tokens: bool, idle: bool = False):
    """The `tokenizers` Encoding of `text`, computed without holding the GIL: `Tokenizer.encode` holds it for the
    whole call (a long prompt would stall the event loop and the engine thread, that is every stream's next token,
    for as long as it takes); `encode_batch` releases it and gives the same ids and character offsets. A text over
    LONG_TEXT characters, or any text with `idle`, is tokenized on an idle-priority thread (_lower_priority), so that
    it takes only CPU the decoding streams leave."""
    if len(text) <= LONG_TEXT and not idle:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    job = _background.submit(tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)
    return job.result()[0]


def prompt_overflows(tok, text: str, limit: int, *, add_special_tokens: bool) -> int | None:
    """A lower bound on `text`'s token count, when tokenizing a prefix of it already proves the count reaches
    `limit` (the context length); None when it does not (then the caller tokenizes the whole text as before).

    A prompt that fits has at most `limit` tokens of the vocabulary's longest piece each, so a prefix of a few
    characters per context token is tried first, then prefixes twice as long, up to half the text: the extra work
    is at most one more tokenization of the text, and a 30 MiB prompt costs a 100 KiB tokenization. Only tokens
    that end before the prefix's last two pre-tokenized words are counted: the pre-tokenizer splits the same way
    up to there whatever follows, and byte-level BPE never merges across its words, so those tokens are exactly
    the whole text's first tokens. Tokenizers without a pre-tokenizer (which may merge across any boundary), and
    prefixes whose tail is one unbroken word, prove nothing: the text is tokenized in full."""
    pre = tok.pre_tokenizer
    if pre is None:
        return None
    size = (limit + 1) * 4
    while size <= len(text) // 2:
        prefix = text[:size]
        tail_start = max(0, size - 4096)
        words = pre.pre_tokenize_str(prefix[tail_start:])
        if len(words) < 3:
            return None  # one word (or two) fills the tail: its tokens may depend on what follows
        boundary = tail_start + words[-2][1][0]
        # idle priority: only a text far longer than the context gets here, and it is most likely refused
        enc = encode(tok, prefix, add_special_tokens=add_special_tokens, idle=True)
        settled = sum(1 for start, end in enc.offsets if end <= boundary)
        if settled >= limit:
            return settled
        size *= 2
    return None


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def token_limits(
    prompt_len: int,
    max_tokens: int | None,
    min_tokens: int | None,
    ctx: ServingContext,
    *,
    max_param: str,
    prompt_param: str = "prompt",
    too_long: Callable[[int, int], str] | None = None,
) -> tuple[int, int]:
    """(max_tokens, min_tokens) for a prompt of `prompt_len` tokens: -1 or unset means "up to the context"; a
    request that cannot fit the context is a 400 naming the field to change."""
    room = ctx.max_model_len - prompt_len
    if room <= 0:
        message = (
            too_long(prompt_len, ctx.max_model_len)
            if too_long
            else f"prompt is {prompt_len} tokens; the model's context length is {ctx.max_model_len}"
        )
        raise APIError(400, message, param=prompt_param, code="context_length_exceeded")
    limit = room if max_tokens in (None, -1) else max_tokens
    if limit > room:
        message = (
            too_long(prompt_len + limit, ctx.max_model_len)
            if too_long
            else f"prompt ({prompt_len} tokens) plus {max_param} ({limit}) is {prompt_len + limit}, over the model's "
            f"context length of {ctx.max_model_len}"
        )
        raise APIError(400, message, param=max_param, code="context_length_exceeded")
    least = room if min_tokens == -1 else (min_tokens or 0)
    return limit, min(least, limit)


def sampling_params(
    req: Any,
    ctx: ServingContext,
    *,
    max_tokens: int,
    min_tokens: int,
    stop: list[str],
    logprobs: int | None,
    logit_bias: dict[int, float] | None = None,
    **own: Any,
) -> SamplingParams:
    """The engine's SamplingParams for a request of either front, built here once: the sampling fields both
    contracts share (temperature, top_p, seed, penalties, logit_bias) with the hosted API's defaults, the resolved
    lengths, stops and logprobs, and the front's own fields (`own`: grammar, lark, prediction, ...).
    `logit_bias` already resolved (a completions request shares it across prompts) or None to resolve it here."""
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=stop,
        logprobs=logprobs,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=resolve_logit_bias(req.logit_bias, ctx) if logit_bias is None else logit_bias,
        **own,
    )


@dataclass
class Sequence:
    """What the front has seen of one engine sequence (one choice or candidate)."""

    prompt_index: int
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


class Run:
    """A request's sequences on the engine: prompt `i` of `prompts` runs `per_prompt` times with `params[i]`
    (seeded candidates draw seed, seed+1, ...). Keeps one id and one `created` for the whole request."""

    def __init__(
        self,
        ctx: ServingContext,
        id_prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        per_prompt: int,
        fail_after: int | None = None,
    ):
        import uuid

        self.ctx, self.prompts, self.params, self.per_prompt = ctx, prompts, params, per_prompt
        self.fail_after = fail_after
        self.cache_key: str | None = None  # the request's prompt_cache_key: replicas on Ray route by it
        self.id = f"{id_prefix}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.seqs = [Sequence(i) for i in range(len(prompts)) for _ in range(per_prompt)]
        self.on_finish: Callable[[Run], None] | None = None  # called once when the request ends, however it ends

    def _finished(self) -> None:
        callback, self.on_finish = self.on_finish, None
        if callback is not None:
            callback(self)

    def _generate(self, k: int) -> AsyncIterator[GenerationEvent]:
        i = self.seqs[k].prompt_index
        params = self.params[i]
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + k % self.per_prompt)
        request_id = f"{self.id}-{k}"
        if self.fail_after is not None:
            self.ctx.engine.inject_fault(request_id, self.fail_after)
        return self.ctx.engine.generate(request_id, self.prompts[i], params, cache_key=self.cache_key)

    async def collect(self, is_disconnected) -> None:
        """Run every sequence to its end; a failed sequence fails the request with its error's status."""

        async def run(k: int) -> None:
            async for ev in self._generate(k):
                self.seqs[k].absorb(ev)

        tasks = [asyncio.create_task(run(k)) for k in range(len(self.seqs))]
        watcher = asyncio.create_task(_watch(is_disconnected, tasks))
        try:
            await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            self._finished()
        failed = next((s for s in self.seqs if s.error), None)
        if failed is not None:
            raise engine_error(failed.error)

    async def start(self) -> None:
        """Start every sequence and wait for each one's first event, so that a request the engine refuses
        (overloaded, invalid, unavailable) gets a real HTTP status instead of a 200 and an error chunk."""
        self._queue: asyncio.Queue = asyncio.Queue()

        async def run(k: int) -> None:
            try:
                async for ev in self._generate(k):
                    await self._queue.put((k, ev))
            except Exception as exc:  # surfaced to the client as an error chunk
                log.exception("stream failed")
                error = RequestError(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}")
                await self._queue.put((k, GenerationEvent("", finished=True, error=error)))

        self._tasks = [asyncio.create_task(run(k)) for k in range(len(self.seqs))]
        self._early: list[tuple[int, GenerationEvent]] = []
        heard: set[int] = set()
        try:
            while len(heard) < len(self.seqs):
                k, ev = await self._queue.get()
                if ev.error:
                    raise engine_error(ev.error)
                heard.add(k)
                self._early.append((k, ev))
        except BaseException:
            for t in self._tasks:
                t.cancel()
            self._finished()
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """After `start`: every sequence's events as they come, merged, as (sequence index, event); ends when all
        have finished. An exception in a sequence becomes its error event. (A response that never starts this
        generator calls `close` instead: see api.server.RunStream.)"""
        remaining = len(self.seqs)
        try:
            while remaining:
                k, ev = self._early.pop(0) if self._early else await self._queue.get()
                self.seqs[k].absorb(ev)
                if ev.finished:
                    remaining -= 1
                yield k, ev
        finally:
            for t in self._tasks:
                t.cancel()
            self._finished()

    def close(self) -> None:
        """End the run however its response ended: the sequences stop, `on_finish` runs (once)."""
        for t in getattr(self, "_tasks", ()):
            t.cancel()
        self._finished()

    def usage(self, completion_details: dict | None = None) -> dict:
        """Prompt tokens once per prompt, cached tokens once per prompt (never above its length)."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        cached = 0
        for i, p in enumerate(self.prompts):
            hits = [s.last.num_cached_tokens for s in self.seqs if s.prompt_index == i and s.last]
            cached += min(max(hits, default=0), len(p))
        completion = sum(s.generated for s in self.seqs)
        out = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if completion_details is not None:
            out["completion_tokens_details"] = completion_details
        return out

    def time_info(self) -> dict:
        total = time.perf_counter() - self.started
        lasts = [s.last for s in self.seqs if s.last is not None]
        queue = min((e.queue_time for e in lasts), default=0.0)
        prompt = max((e.prompt_time for e in lasts), default=0.0)
        return {
            "queue_time": queue,
            "prompt_time": prompt,
            "completion_time": max(0.0, total - queue - prompt),
            "total_time": total,
            "created": time.time(),
        }


async def _watch(is_disconnected, tasks: list[asyncio.Task]) -> None:
    """Cancel the sequences of a non-streaming request whose client went away."""
    while True:
        await asyncio.sleep(0.2)
        if await is_disconnected():
            for t in tasks:
                t.cancel()
            return


# characters that str.splitlines() (httpx's iter_lines, and so its users) takes for line ends; JSON may hold them raw
_LINE_BREAKS = {c: f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}
_ESCAPE_LINE_BREAKS = str.maketrans(_LINE_BREAKS)


def sse(obj: dict) -> str:
    """One SSE event; the JSON escapes every character a client might split a line at, so one event stays one line."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_ESCAPE_LINE_BREAKS)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
