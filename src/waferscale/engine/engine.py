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

from waferscale.engine import sampler
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.kv_cache import KVPool, PagedBatch
from waferscale.engine.metrics import Histogram
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams
from waferscale.engine.sequence import Sequence
from waferscale.models.llama import cpu_has_native_bf16
from waferscale.models.loader import LoadedModel

log = logging.getLogger("waferscale.engine")
DEFAULT_KV_CACHE_BYTES = 1 << 30


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
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.generated_tokens = 0
        self.ttft = Histogram()  # arrival to first token
        self.itl = Histogram()  # between consecutive tokens of a sequence

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
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Forget a sequence (its client went away) and free its blocks; no event is sent for it."""
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._free(seq)
        self.running = [s for s in self.running if s.request_id != request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)

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
        }

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[GenerationEvent]:
        """Schedule, run one batched forward, sample; return the events produced."""
        events: list[GenerationEvent] = []
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, events):
                break
            self.waiting.popleft()
            if seq.finished:
                continue
            self.running.append(seq)
            chunk = min(seq.remaining, budget)
            prefills.append((seq, chunk))
            budget -= chunk
        return decodes, prefills

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
        hashes = self.blocks.block_hashes(tokens[:-1])
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
            lengths = [len(s.token_ids) for s in decodes]
            longest = max(lengths)
            ctx = torch.zeros(len(decodes), longest, dtype=torch.long)
            for i, seq in enumerate(decodes):
                ctx[i, : lengths[i]] = self._slots(seq, 0, lengths[i])
            batch.num_decode = len(decodes)
            batch.decode_ctx = ctx
            batch.decode_mask = (torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1))[
                :, None, None
            ]
            slots.append(ctx[torch.arange(len(decodes)), torch.tensor(lengths) - 1])
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
            batch.prefills.append((row, row + chunk, self._slots(seq, 0, end), start))
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
            for i, (seq, _) in enumerate(sample_rows):
                try:
                    if seq.params.max_tokens == 0:
                        seq.finish_reason = "length"
                    else:
                        self._sample(seq, logits[i])
                except Exception as exc:  # one sequence's failure ends that sequence only
                    log.exception("sampling failed for %s", seq.request_id)
                    events.append(self._fail(seq, exc))
                    continue
                events.append(self._event(seq))
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
    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.params
        if params.fail_after is not None and seq.num_generated >= params.fail_after:
            raise RuntimeError("injected fault")
        controlled = sampler.apply_controls(
            logits, params, seq.output_counts, self.eos_ids, seq.num_generated
        )
        token = sampler.draw(controlled, params, seq.generator)
        logprobs = torch.log_softmax(logits, -1)
        k = params.logprobs or 0
        lp, top = sampler.token_logprobs(logprobs, token, k)
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
            seq.finish_reason = "stop"
            return
        seq.output_ids.append(token)
        seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
        if params.logprobs is not None:
            seq.logprobs.append(
                TokenLogprob(
                    token_id=token,
                    text=self.tokenizer.token_text(token),
                    logprob=lp,
                    top=[(self.tokenizer.token_text(i), v) for i, v in top] if k else None,
                    offset=len(seq.detokenizer.text),
                )
            )
        if index < params.min_tokens:
            seq.detokenizer.add(token)
            seq.detokenizer.ignore_stops_so_far()
        elif seq.detokenizer.add(token) is not None:
            seq.finish_reason = "stop"
            return
        if seq.num_generated >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"

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
        return GenerationEvent(
            seq.request_id, finished=True, error=f"generation failed: {type(exc).__name__}"
        )

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
