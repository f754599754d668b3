"""The engine loop: continuous batching over a paged KV cache with prefix caching.

Every `step()` asks the Scheduler what to run, has the ModelRunner run it in one forward, and hands the logits to
the OutputProcessor, which samples and builds the events. Sequences join and leave at every step.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from waferscale import kernels
from waferscale.engine import sampler
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.draft_model import DRAFT_KV_FRACTION, DraftModel, check_same_vocabulary
from waferscale.engine.errors import ErrorKind, RequestError, internal_error
from waferscale.engine.faults import FaultHooks
from waferscale.engine.grammar import GrammarError, GrammarMasks
from waferscale.engine.kv_cache import KVPool, StepInterrupted, kv_cache_dtypes
from waferscale.engine.metrics import EngineStats
from waferscale.engine.model_runner import ModelRunner
from waferscale.engine.output_processor import OutputProcessor
from waferscale.engine.outputs import GenerationEvent
from waferscale.engine.params import BATCH_PRIORITY, SamplingParams
from waferscale.engine.row_costs import draft_cost_ratio, measure_row_costs, measured_once, row_sizes
from waferscale.engine.scheduler import ScheduledBatch, Scheduler
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import SpeculativeConfig
from waferscale.engine.step_budget import default_step_tokens
from waferscale.engine.thread_governor import ThreadGovernor
from waferscale.heap import keep_freed_heap
from waferscale.models.loader import LoadedModel

log = logging.getLogger("waferscale.engine")
DEFAULT_KV_CACHE_BYTES = 512 << 20
SHORT_CHUNK_ROWS = 64  # a prompt chunk of up to this many tokens (a short prompt, a cached prompt's tail) runs as decode rows


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_prefix_cache: bool = True,
        queue_timeout: float | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: LoadedModel | None = None,
        draft_kv_cache_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
    ):
        self.loaded = loaded
        keep_freed_heap()  # a step's buffers reuse what the last step freed (in a VM each new page costs microseconds)
        speculative = speculative or SpeculativeConfig()
        if (speculative.method == "draft") != (draft is not None):
            raise ValueError("a draft model goes with speculative method draft, and only with it")
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.eos_ids = [i for i in loaded.tokenizer.eos_token_ids if i < loaded.config.vocab_size]
        cfg = loaded.config
        kv_dtype, compute_dtype = kv_cache_dtypes(kv_cache_dtype, loaded.dtype)
        if max_num_batched_tokens is None:  # the model's default: more tokens a step for a mixture of experts
            max_num_batched_tokens = default_step_tokens(cfg.num_experts, cfg.num_experts_per_tok)
        self.block_size = block_size
        # decode attention reads the pool in place through the native kernel where it could be built
        self.native = kernels.load() if kv_dtype in (torch.float32, torch.bfloat16, torch.int8) else None
        self.pool = KVPool.for_model(cfg, kv_dtype, compute_dtype, block_size, kv_cache_bytes)
        self.blocks = BlockManager(self.pool.num_blocks, block_size, enable_prefix_cache, self.pool.layout.block_kinds)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            queue_timeout=queue_timeout,
            max_model_len=self.max_model_len,
            speculative=speculative,
        )
        self.runner = ModelRunner(self.model, self.pool, self.native, self.blocks, rows_upto=SHORT_CHUNK_ROWS)
        self.drafter: DraftModel | None = None
        if draft is not None:
            check_same_vocabulary(loaded, draft)
            self.drafter = DraftModel(
                draft,
                speculative,
                kv_cache_bytes=draft_kv_cache_bytes or kv_cache_bytes // DRAFT_KV_FRACTION,
                block_size=block_size,
                max_batched_tokens=max_num_batched_tokens,
            )
        self._log_kv(kv_dtype, self.pool.page_bytes)
        if speculative.enabled:  # the server's own drafts are capped at what pays for their rows on this machine
            sizes = row_sizes(speculative.max_draft, speculative.max_seqs)
            key = (loaded.fingerprint, loaded.dtype, loaded.quantization, kv_dtype, block_size, torch.get_num_threads())
            self.scheduler.row_costs = measured_once(
                key + tuple(sizes),
                lambda: measure_row_costs(
                    self.runner, self.blocks, self.runner.logits, sizes, self.eos_ids[0] if self.eos_ids else 0
                ),
            )
            log.info("a decoding step's time by rows, against one row's: %s", self.scheduler.row_costs.describe())
        if self.drafter is not None:  # and a draft model's drafts, at what making them costs too
            d, token = self.drafter, self.eos_ids[0] if self.eos_ids else 0
            d_key = ("draft", draft.fingerprint, draft.dtype, draft.quantization, block_size, torch.get_num_threads())
            one = self.scheduler.row_costs.at(1)
            ratio = measured_once(
                (d_key, key),
                lambda: draft_cost_ratio(
                    (self.runner, self.blocks, self.runner.logits), (d.runner, d.blocks, d.runner.logits), token
                ),
            )
            d.token_seconds = ratio * one
            log.info("a draft token costs %.2fx a one-row step of the target", ratio)
        self.faults = FaultHooks()
        self.threads = ThreadGovernor(
            torch.get_num_threads(), torch.set_num_threads, applied=torch.get_num_threads
        )
        self.grammars = GrammarMasks(loaded.tokenizer.tokenizer, cfg.vocab_size, self.eos_ids)
        self.output = OutputProcessor(
            self.tokenizer,
            self.eos_ids,
            self.grammars,
            self.native,
            self.max_model_len,
            self.runner.logits,
            self.scheduler.free,
            self.faults,
            speculative.max_draft,
        )
        self.failed_steps = 0
        # set (by AsyncEngine) when an interactive request arrives: a step of batch work alone stops between layers
        # and the next step takes the request in, rather than making it wait out the whole step
        self.interactive_arrived = threading.Event()
        self.interrupted_steps = 0
        self._early_events: list[GenerationEvent] = []  # requests that ended before reaching the scheduler

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens whose keys and values the pool holds in every layer (page 0, the padding page, left out)."""
        return (self.blocks.num_blocks - 1) // sum(k.pages for k in self.blocks.kinds) * self.block_size

    def _log_kv(self, kv_dtype: torch.dtype, per_page: int) -> None:
        """The pool's size, each kind's KB a token, and the longest sequence it holds."""
        cfg, bs = self.loaded.config, self.block_size
        kinds = ", ".join(
            f"{k.pages * per_page / bs / 1024:.1f} KB a token in {k.pages * self.pool.layout.group_size} "
            + (
                "whole-context layers"
                if k.window is None
                else f"layers of window {k.window} (at most "
                f"{self.scheduler.window_blocks(k.window) * bs} tokens a sequence)"
            )
            for k in self.blocks.kinds
        )
        longest = self.scheduler.capacity_tokens()
        log.info(
            "KV cache: %d MiB, %d tokens in every layer; %s; one sequence fits %s tokens (%s, %d KV heads of %d)",
            self.pool.nbytes >> 20,
            self.kv_cache_tokens,
            kinds,
            "any number of" if longest is None else longest,
            str(kv_dtype).removeprefix("torch.")
            + (" with a float32 scale per token, head and 64 channels" if kv_dtype == torch.int8 else ""),
            cfg.num_kv_heads,
            cfg.head_dim,
        )

    # ------------------------------------------------------------------ interface
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; one that cannot be served ends at the next step with an error event of its own."""
        try:
            if self.faults.on_add is not None:
                self.faults.on_add(request_id)
            seq = Sequence(
                request_id=request_id,
                prompt_ids=list(prompt_ids),
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens
                ),
                generator=sampler.make_generator(params),
            )
            if params.lark is not None:
                seq.matcher = self.grammars.lark_matcher(params.lark)
            elif params.grammar is not None:
                seq.matcher = self.grammars.matcher(params.grammar, self.tokenizer.decode(prompt_ids))
        except GrammarError as exc:  # the request's grammar (or the prompt it must continue) is the client's
            param = "lark" if params.lark is not None else "grammar_root"
            self._early_events.append(
                self._error(request_id, RequestError(ErrorKind.INVALID_REQUEST, str(exc), param))
            )
            return
        except Exception as exc:
            log.exception("adding request %s failed", request_id)
            self._early_events.append(self._error(request_id, internal_error(exc)))
            return
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Forget a sequence (its client went away) and free its blocks; no event is sent for it."""
        self.scheduler.abort(request_id)
        self.faults.fail_after.pop(request_id, None)

    def fail_all(self, error: RequestError) -> list[GenerationEvent]:
        """End every sequence with an error event (shutdown after the grace period) and free its blocks."""
        return self._drain_early() + [self.output.fail(seq, error) for seq in self.scheduler.take_all()]

    def stats(self) -> EngineStats:
        """A snapshot for monitoring (may be read from another thread: plain ints, no locking needed)."""
        b, s, o = self.blocks, self.scheduler, self.output
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=b.num_used,
            kv_blocks_free=b.num_available,
            kv_blocks_cached=b.evictable_pages,
            kv_cache_bytes=self.pool.nbytes,
            kv_cache_tokens=self.kv_cache_tokens,
            prefix_cache_queries=b.queries,
            prefix_cache_hits=b.hits,
            generated_tokens=o.generated_tokens,
            preemptions=s.num_preemptions,
            queue_timeouts=s.num_timed_out,
            failed_steps=self.failed_steps,
            interrupted_steps=self.interrupted_steps,
            speculative_draft_tokens=o.speculative_drafts,
            speculative_accepted_tokens=o.speculative_accepted,
            ttft=o.ttft.snapshot(),
            itl=o.itl.snapshot(),
            expert_load=self.model.expert_load(),
        )

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._early_events)

    def step(self) -> list[GenerationEvent]:
        """Schedule, run one batched forward, sample; return the events produced.

        A step that raises fails the sequences it was running (an internal error each) and the engine goes on."""
        events = self._drain_early()
        batch: ScheduledBatch | None = None
        try:
            if self.faults.on_step is not None:
                self.faults.on_step()
            if self.drafter is not None:  # its proposals, for the scheduler to take as drafts
                self._draft()
            batch = self.scheduler.schedule()
            events += [self.output.event(seq) for seq in batch.ended]
            if batch.decodes or batch.prefills:
                key = (
                    None if batch.prefills else len(batch.decodes).bit_length()
                )  # decode steps, by batch size
                threads = self.threads.threads_for(key)
                start = time.perf_counter()
                ran = self._run(batch, self.interactive_arrived if self._interruptible(batch) else None)
                if ran is None:  # interrupted: run again (or not) by the next step's plan
                    self.interrupted_steps += 1
                else:
                    events += ran
                    self.threads.record(key, threads, time.perf_counter() - start)
        except Exception as exc:
            log.exception("engine step failed")
            self.failed_steps += 1
            victims = batch.seqs if batch is not None else list(self.scheduler.running)
            events += [self.output.fail(seq, internal_error(exc)) for seq in victims if not seq.finished]
        self.scheduler.retire()
        if self.drafter is not None:
            self.drafter.retire(self.scheduler.running)
        return events

    # ------------------------------------------------------------------ internals
    def _run(self, batch: ScheduledBatch, interrupt: threading.Event | None = None) -> list[GenerationEvent] | None:
        """The step's forward, sampling and verification; None when `interrupt` stopped the forward (nothing is
        committed: every sequence is where it was)."""
        # drafts to verify: each row gets the numbers decoding it alone would (speculation never changes an answer)
        with kernels.rows_exact(any(s.drafts for s, _ in batch.prefills)):
            try:
                out = self.runner.forward(batch, interrupt)
            except StepInterrupted:
                return None
            self.scheduler.computed(batch)
            for seq, first, pos, count in out.score_rows:
                self.output.score_prompt(seq, out.hidden[first : first + count], pos)
            events = []
            if out.sample_rows:
                logits = self.runner.logits(out.hidden[[r for _, r in out.sample_rows]])
                events = self.output.sample([seq for seq, _ in out.sample_rows], logits)
            for seq, first, count in out.draft_rows:
                events += self.output.verify(seq, self.runner.logits(out.hidden[first : first + count]))
                self.scheduler.settle_drafts(seq)
        return events

    def _interruptible(self, batch: ScheduledBatch) -> bool:
        """Whether an interactive arrival may stop this step: batch work only, and no drafts to verify (the draft
        model's state and the scheduler's drafts move on with the step)."""
        return self.drafter is None and all(s.params.priority >= BATCH_PRIORITY and not s.drafts for s in batch.seqs)

    def _draft(self) -> None:
        """The draft model's proposals for this step; should it fail, the step goes on without drafts (the draft
        starts again from nothing) rather than failing its sequences."""
        try:
            self.drafter.prepare(self.scheduler.running, self.max_model_len, self.scheduler.row_costs)
        except Exception:
            log.exception("the draft model failed: this step decodes without drafts")
            self.drafter.retire([])

    def _drain_early(self) -> list[GenerationEvent]:
        events, self._early_events = self._early_events, []
        return events

    def _error(self, request_id: str, error: RequestError) -> GenerationEvent:
        self.faults.fail_after.pop(request_id, None)
        return GenerationEvent(request_id, finished=True, error=error)
