"""The engine: continuous batching over a paged KV cache with prefix caching.

Every `step()` runs one forward over a batch of all running sequences: one token for each decoding sequence and a
chunk of each prefilling one, within a token budget, so a long prompt never stalls the decodes for long.
Sequences join and leave at every step. When the KV pool runs out, the newest sequence is preempted (its blocks
freed) and recomputed later; its client still gets the whole answer.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from waferscale import kernels
from waferscale.engine import sampler
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.grammar import CALL_ROOTS, GrammarError, GrammarMasks, is_function_call
from waferscale.engine.kv_cache import KVPool, PagedBatch
from waferscale.engine.metrics import Histogram
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams
from waferscale.engine.sequence import Sequence
from waferscale.models.llama import cpu_has_native_bf16
from waferscale.models.loader import LoadedModel

log = logging.getLogger("waferscale.engine")
DEFAULT_KV_CACHE_BYTES = 512 << 20


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_cache: bool = True,
        queue_timeout: float | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.eos_ids = [i for i in loaded.tokenizer.eos_token_ids if i < loaded.config.vocab_size]
        cfg = loaded.config
        # attention runs in float32 where the CPU only emulates bf16/fp16 (several times faster there)
        kv_dtype = loaded.dtype if cpu_has_native_bf16() else torch.float32
        per_block = KVPool.bytes_per_block(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, block_size
        )
        num_blocks = max(2, kv_cache_bytes // per_block)
        self.block_size = block_size
        # decode attention reads the pool in place through the native kernel where it could be built
        self.native = kernels.load() if kv_dtype in (torch.float32, torch.bfloat16) else None
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache)
        self.max_num_seqs = max_num_seqs
        self.queue_timeout = queue_timeout  # seconds a request may wait for its first admission
        self.num_timed_out = 0
        self.max_num_batched_tokens = max(max_num_batched_tokens, 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.generated_tokens = 0
        self.ttft = Histogram()  # arrival to first token
        self.itl = Histogram()  # between consecutive tokens of a sequence
        self.grammars = GrammarMasks(loaded.tokenizer.tokenizer, cfg.vocab_size, self.eos_ids)
        self._early_events: list[GenerationEvent] = []  # requests that ended before reaching the scheduler

    # ------------------------------------------------------------------ interface
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed % 2**64 if params.seed is not None else int(torch.seed()))
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop),
            generator=generator,
        )
        if params.grammar is not None or params.lark is not None:
            try:
                if params.lark is not None:
                    seq.matcher = self.grammars.lark_matcher(params.lark)
                else:
                    seq.matcher = self.grammars.matcher(params.grammar, self.tokenizer.decode(prompt_ids))
            except GrammarError as exc:
                self._early_events.append(GenerationEvent(request_id, finished=True, error=str(exc)))
                return
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Forget a sequence (its client went away) and free its blocks; no event is sent for it."""
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._free(seq)
        self.running = [s for s in self.running if s.request_id != request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)

    def fail_all(self, message: str, status: int = 503) -> list[GenerationEvent]:
        """End every sequence with an error event (shutdown after the grace period) and free its blocks."""
        events = []
        for seq in self.running + list(self.waiting):
            self._free(seq)
            seq.finish_reason = "error"
            events.append(GenerationEvent(seq.request_id, finished=True, error=message, error_status=status))
        self.running, self.waiting = [], deque()
        return events

    def stats(self) -> dict[str, float]:
        """Counters for /metrics (read from another thread: plain ints, no locking needed)."""
        b = self.blocks
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": b.num_used,
            "kv_blocks_free": b.num_available,
            "kv_blocks_cached": len(b.evictable),
            "prefix_cache_queries": b.queries,
            "prefix_cache_hits": b.hits,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.num_preemptions,
            "queue_timeouts": self.num_timed_out,
        }

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._early_events)

    def step(self) -> list[GenerationEvent]:
        """Schedule, run one batched forward, sample; return the events produced."""
        events, self._early_events = self._early_events, []
        decodes, prefills = self._schedule(events)
        if decodes or prefills:
            try:
                events += self._run(decodes, prefills)
            except Exception as exc:  # a failed forward fails the sequences in it, never the engine
                log.exception("forward failed")
                for seq in decodes + [s for s, _ in prefills]:
                    events.append(self._fail(seq, exc))
        self.running = [s for s in self.running if not s.finished]
        return events

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, events: list[GenerationEvent]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        budget = self.max_num_batched_tokens
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq.finished or seq.remaining != 1 or not seq.num_generated or budget <= 0:
                continue
            if seq not in self.running:  # preempted while making room for an older sequence
                continue
            if not self._ensure_blocks(seq, len(seq.token_ids)):
                continue  # seq itself was preempted
            decodes.append(seq)
            budget -= 1
        prefills: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq in decodes or seq.finished or seq.remaining <= 0 or budget <= 0:
                continue
            chunk = min(seq.remaining, budget)
            prefills.append((seq, chunk))
            budget -= chunk
        self._expire_waiting(events)
        in_flight = self._prefix_hashes_in_flight()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._shares_prefix_in_flight(seq, in_flight):
                deferred.append(self.waiting.popleft())  # admitted once those blocks are cached
                continue
            if not self._admit(seq, events):
                break
            self.waiting.popleft()
            if seq.finished:
                continue
            in_flight.update(seq.prompt_hashes[len(seq.block_hashes) :])
            self.running.append(seq)
            chunk = min(seq.remaining, budget)
            prefills.append((seq, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(deferred))
        return decodes, prefills

    def _expire_waiting(self, events: list[GenerationEvent]) -> None:
        """End the requests that have waited for admission longer than the queue timeout (503, never a hang)."""
        if self.queue_timeout is None or not self.waiting:
            return
        now = time.perf_counter()
        keep: deque[Sequence] = deque()
        for seq in self.waiting:
            if not seq.admitted_once and now - seq.arrival > self.queue_timeout:
                seq.finish_reason = "error"
                self.num_timed_out += 1
                message = (
                    f"the request waited {now - seq.arrival:.0f} s for a free slot (queue timeout "
                    f"{self.queue_timeout:g} s); the server is overloaded, retry later"
                )
                events.append(GenerationEvent(seq.request_id, finished=True, error=message, error_status=503))
            else:
                keep.append(seq)
        self.waiting = keep

    def _prefix_hashes_in_flight(self) -> set[int]:
        """Hashes of full prompt blocks that running sequences are still prefilling."""
        if not self.blocks.enable_prefix_cache:
            return set()
        return {h for s in self.running for h in s.prompt_hashes[len(s.block_hashes) :]}

    def _shares_prefix_in_flight(self, seq: Sequence, in_flight: set[int]) -> bool:
        """Whether seq's next uncached prompt block is being computed right now by another sequence (the other
        choices of an `n`/`best_of` request, or a concurrent request with the same prompt): better to wait a step
        or two and take it from the cache than to compute it twice."""
        if not in_flight or seq.params.prompt_logprobs:
            return False
        hashes = self._prompt_hashes(seq)
        cached = len(self.blocks.match(hashes, count=False))
        return cached < len(hashes) and hashes[cached] in in_flight

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of seq's full blocks before its last token, computed once per token count (a preempted
        sequence has grown since)."""
        if seq.prompt_hashes is None or len(seq.prompt_hashes) != (len(seq.token_ids) - 1) // self.block_size:
            seq.prompt_hashes = self.blocks.block_hashes(seq.token_ids[:-1])
        return seq.prompt_hashes

    def _admit(self, seq: Sequence, events: list[GenerationEvent]) -> bool:
        """Give a waiting sequence its blocks (reusing cached prefix blocks); False if the pool cannot yet."""
        if seq.params.max_tokens == 0 and not seq.params.prompt_logprobs:
            seq.scheduled_at = time.perf_counter()
            seq.finish_reason = "length"
            events.append(self._event(seq))
            return True
        tokens = seq.token_ids
        needed = -(-len(tokens) // self.block_size)
        if needed > self.blocks.num_blocks - 1:
            seq.finish_reason = "error"
            events.append(
                GenerationEvent(seq.request_id, finished=True, error="the prompt does not fit the KV cache")
            )
            return True
        # the last token is always computed (its logits are needed), so only blocks before it may come from cache
        hashes = self._prompt_hashes(seq)
        reused = [] if seq.params.prompt_logprobs else self.blocks.match(hashes)
        if not self.blocks.can_allocate(needed - len(reused), reused):
            if not self.running:
                seq.finish_reason = "error"
                events.append(
                    GenerationEvent(seq.request_id, finished=True, error="the KV cache is too small")
                )
                return True
            return False
        for b in reused:
            self.blocks.acquire(b)
        seq.block_table = reused + [self.blocks.allocate() for _ in range(needed - len(reused))]
        seq.block_hashes = hashes[: len(reused)]
        seq.num_computed = len(reused) * self.block_size
        if not seq.admitted_once:
            seq.num_cached = seq.num_computed
            seq.scheduled_at = time.perf_counter()
            seq.admitted_once = True
        return True

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` in seq's blocks, preempting the newest sequences if needed."""
        while len(seq.block_table) * self.block_size < num_tokens:
            if self.blocks.num_available == 0:
                victim = next(s for s in reversed(self.running) if not s.finished)
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(self.blocks.allocate())
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    # ------------------------------------------------------------------ forward
    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _run(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> list[GenerationEvent]:
        ids, positions, slots = [], [], []
        for seq in decodes:
            p = len(seq.token_ids) - 1
            ids.append(seq.token_ids[p])
            positions.append(p)
        batch = PagedBatch(self.pool, torch.empty(0, dtype=torch.long))
        if decodes:
            lengths = torch.tensor([len(s.token_ids) for s in decodes])
            width = max(len(s.block_table) for s in decodes)
            tables = torch.zeros(len(decodes), width, dtype=torch.long)
            for i, seq in enumerate(decodes):
                tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table)
            batch.num_decode = len(decodes)
            batch.decode_tables = tables
            batch.decode_lengths = lengths
            batch.native = self.native
            if self.native is None:  # the native kernels stop at each row's length themselves
                batch.decode_mask = (
                    torch.arange(width * self.block_size).unsqueeze(0) < lengths.unsqueeze(1)
                )[:, None, None]
            last = lengths - 1
            slots.append(
                tables[torch.arange(len(decodes)), last // self.block_size] * self.block_size
                + last % self.block_size
            )
        row = len(decodes)
        sample_rows: list[tuple[Sequence, int]] = [(s, i) for i, s in enumerate(decodes)]
        score_rows: list[
            tuple[Sequence, int, int, int]
        ] = []  # prompt logprobs: seq, first row, first pos, count
        for seq, chunk in prefills:
            start = seq.num_computed
            end = start + chunk
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.append(self._slots(seq, start, end))
            table = torch.tensor(seq.block_table[: -(-end // self.block_size)])
            batch.prefills.append((row, row + chunk, table, start, end))
            if seq.params.prompt_logprobs and not seq.prompt_logprobs_sent:
                score_rows.append((seq, row, start, chunk))
            if end == len(seq.token_ids):
                sample_rows.append((seq, row + chunk - 1))
            row += chunk
        batch.slots = torch.cat(slots)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), batch)
        for seq in decodes:
            seq.num_computed += 1
        for seq, chunk in prefills:
            seq.num_computed += chunk
        for seq in decodes + [s for s, _ in prefills]:
            self._register_full_blocks(seq)
        for seq, first, pos, count in score_rows:
            self._score_prompt(seq, hidden[first : first + count], pos)
        events = []
        if sample_rows:
            logits = self.model.logits(hidden[[r for _, r in sample_rows]])
            events += self._sample([seq for seq, _ in sample_rows], logits)
        return events

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = min(seq.num_computed, len(seq.token_ids)) // self.block_size
        if full > len(seq.block_hashes):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            start = len(seq.block_hashes) * self.block_size
            new = self.blocks.block_hashes(seq.token_ids[start : full * self.block_size], parent)
            for i, h in enumerate(new):
                self.blocks.register(seq.block_table[len(seq.block_hashes) + i], h)
            seq.block_hashes += new

    # ------------------------------------------------------------------ sampling and events
    def _grammar_masks(self, seqs: list[Sequence], events: list[GenerationEvent]) -> dict[int, torch.Tensor]:
        """Allowed-token rows of the grammar-constrained sequences (one batched call; the others pay nothing)."""
        constrained = [s for s in seqs if s.matcher is not None and s.params.max_tokens > 0]
        if not constrained:
            return {}
        try:
            rows = self.grammars.fill([s.matcher for s in constrained])
        except Exception:  # find the failing matchers; the rest of the batch goes on
            rows = []
            for seq in constrained:
                try:
                    rows.append(self.grammars.fill([seq.matcher])[0])
                except Exception as exc:
                    log.warning("grammar mask failed for %s: %s", seq.request_id, exc)
                    events.append(self._fail(seq, exc))
                    rows.append(None)
        return {id(s): r for s, r in zip(constrained, rows) if r is not None}

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[GenerationEvent]:
        """Sample the next token of every sequence from its row of `logits`, in one batched draw.

        A failure in one sequence's controls, grammar or logits ends that sequence only.
        """
        events: list[GenerationEvent] = []
        allowed = self._grammar_masks(seqs, events)
        # logprobs are of the model's own distribution (see docs/api.md): logit - logsumexp, without materialising
        # a whole log_softmax of the batch; a NaN anywhere in a row makes its logsumexp NaN
        if self.native is not None and logits.dtype == torch.float32:
            argmax, lse = self.native.argmax_logsumexp(logits)  # one pass over the rows, not torch's five
        else:
            argmax, lse = None, torch.logsumexp(logits, -1, keepdim=True)
        bad_rows = lse.squeeze(1).isnan().tolist()
        overrides: dict[int, torch.Tensor] = {}  # rows after penalties, bias, min_tokens or a grammar mask
        rows: list[int] = []
        for i, seq in enumerate(seqs):
            params = seq.params
            if seq.finished:  # its grammar failed
                continue
            if params.max_tokens == 0:  # echo-only request: prompt scored, nothing to sample
                seq.finish_reason = "length"
                events.append(self._event(seq))
                continue
            try:
                if params.fail_after is not None and seq.num_generated >= params.fail_after:
                    raise RuntimeError("injected fault")
                if bad_rows[i]:
                    raise FloatingPointError("the model produced NaN logits")
                mask = allowed.get(id(seq))
                if mask is not None or sampler.needs_controls(params, seq.output_counts, seq.num_generated):
                    row = logits[i].clone()
                    sampler.apply_controls(row, params, seq.output_counts, self.eos_ids, seq.num_generated)
                    if mask is not None:
                        masked = row.masked_fill(~mask, float("-inf"))
                        # min_tokens or logit_bias left nothing the grammar allows: the grammar wins
                        if not torch.isfinite(masked).any():
                            masked = logits[i].masked_fill(~mask, float("-inf"))
                        if not torch.isfinite(masked).any():
                            raise GrammarError("the grammar allows no token here")
                        row = masked
                    overrides[i] = row
            except Exception as exc:
                log.warning("sampling failed for %s: %s", seq.request_id, exc)
                events.append(self._fail(seq, exc))
                continue
            rows.append(i)
        if not rows:
            return events
        redrawn = [i for i in rows if i in overrides and seqs[i].params.greedy]
        # greedy rows after their controls: their argmax from one native pass, not torch's per row
        if argmax is not None and redrawn:
            argmax = list(argmax)
            new_max, _ = self.native.argmax_logsumexp(torch.stack([overrides[i] for i in redrawn]))
            for i, a in zip(redrawn, new_max):
                argmax[i] = a
        picked = [seqs[i] for i in rows]
        if len(rows) < len(seqs):
            logits, lse = logits[rows], lse[rows]
            argmax = None if argmax is None else [argmax[i] for i in rows]
            overrides = {j: overrides[i] for j, i in enumerate(rows) if i in overrides}
        tokens = sampler.draw(
            logits, [s.params for s in picked], [s.generator for s in picked], overrides, argmax
        )
        chosen = (logits.gather(1, torch.tensor(tokens).unsqueeze(1)) - lse).squeeze(1).tolist()
        k_max = max(s.params.logprobs or 0 for s in picked)
        top_v, top_i = torch.topk(logits, k_max) if k_max else (None, None)
        if k_max:
            top_v = top_v - lse
        for j, (seq, token) in enumerate(zip(picked, tokens)):
            try:
                k = seq.params.logprobs or 0
                top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else []
                self._accept(seq, token, chosen[j], top)
            except Exception as exc:
                log.warning("sampling failed for %s: %s", seq.request_id, exc)
                events.append(self._fail(seq, exc))
                continue
            events.append(self._event(seq))
        return events

    def _accept(self, seq: Sequence, token: int, lp: float, top: list[tuple[int, float]]) -> None:
        """Append a sampled token: logprobs, stop strings, grammar progress, finish conditions and latencies."""
        params = seq.params
        seq.cumulative_logprob += lp
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.ttft.observe(now - seq.arrival)
        else:
            self.itl.observe(now - seq.last_token_at)
        seq.last_token_at = now
        index = seq.num_generated
        seq.num_generated += 1
        self.generated_tokens += 1
        seq.token_ids.append(token)
        if token in self.eos_ids:
            seq.finish_reason = self._stop_reason(seq)
            return
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            raise GrammarError(seq.matcher.get_error())
        seq.output_ids.append(token)
        seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
        if params.logprobs is not None:
            seq.logprobs.append(
                TokenLogprob(
                    token_id=token,
                    text=self.tokenizer.token_text(token),
                    logprob=lp,
                    top=[(self.tokenizer.token_text(i), v) for i, v in top] if params.logprobs else None,
                    offset=len(seq.detokenizer.text),
                )
            )
        if index < params.min_tokens:
            seq.detokenizer.add(token)
            seq.detokenizer.ignore_stops_so_far()
        elif seq.detokenizer.add(token) is not None:
            seq.finish_reason = "stop"
            return
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar's document is complete
            seq.finish_reason = self._stop_reason(seq)
        elif seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

    def _stop_reason(self, seq: Sequence) -> str:
        """'tool_calls' when a call-capable grammar ended on a function call, else 'stop'."""
        if seq.params.grammar in CALL_ROOTS and is_function_call(seq.detokenizer.text):
            return "tool_calls"
        return "stop"

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor, first_pos: int) -> None:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        ids = seq.prompt_ids
        k = seq.params.logprobs or 0
        text = self.tokenizer.token_text
        if first_pos == 0:
            seq.prompt_logprobs = [TokenLogprob(token_id=ids[0], text=text(ids[0]), logprob=None, top=None)]
        count = min(hidden.shape[0], len(ids) - 1 - first_pos)
        if count <= 0:
            return
        rows = torch.log_softmax(self.model.logits(hidden[:count]), -1)
        for j in range(count):
            tok = ids[first_pos + j + 1]
            lp, top = sampler.token_logprobs(rows[j], tok, k)
            seq.prompt_logprobs.append(
                TokenLogprob(tok, text(tok), lp, [(text(i), v) for i, v in top] if k else None)
            )

    def _fail(self, seq: Sequence, exc: Exception) -> GenerationEvent:
        seq.finish_reason = "error"
        self._free(seq)
        reason = f"grammar: {exc}" if isinstance(exc, GrammarError) else type(exc).__name__
        return GenerationEvent(seq.request_id, finished=True, error=f"generation failed: {reason}")

    def _event(self, seq: Sequence) -> GenerationEvent:
        text, first, last = seq.detokenizer.release(seq.finished)
        prompt_logprobs = None
        if seq.params.prompt_logprobs and seq.prompt_logprobs and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        event = GenerationEvent(
            request_id=seq.request_id,
            text=text,
            token_ids=seq.output_ids[first:last],
            logprobs=seq.logprobs[first:last] if seq.params.logprobs is not None else [],
            prompt_logprobs=prompt_logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached,
            num_generated_tokens=seq.num_generated,
            cumulative_logprob=seq.cumulative_logprob,
        )
        if seq.finished:
            self._free(seq)
            now = time.perf_counter()
            scheduled = seq.scheduled_at or now
            first_token = seq.first_token_at or now
            event.queue_time = scheduled - seq.arrival
            event.prompt_time = max(0.0, first_token - scheduled)
            event.completion_time = max(0.0, now - first_token)
        return event
