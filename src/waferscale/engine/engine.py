"""The engine: a queue of sequences and a `step()` that advances them by one forward pass each call.

Each step gives every running sequence one forward pass (a prefill or one decode), so sequences progress together
and none waits for another to finish. The passes are not yet batched into one forward; the interface
(add_request / abort / step -> events) is the one batching keeps.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from waferscale.engine import sampler
from waferscale.engine.detokenizer import IncrementalDetokenizer
from waferscale.engine.kv_cache import SequenceKVCache
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams
from waferscale.engine.sequence import Sequence
from waferscale.models.loader import LoadedModel

log = logging.getLogger("waferscale.engine")
_LOGIT_CHUNK = 256  # prompt rows turned into logits at once when scoring the prompt


class LLMEngine:
    def __init__(self, loaded: LoadedModel, max_running: int = 256):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.eos_ids = [i for i in loaded.tokenizer.eos_token_ids if i < loaded.config.vocab_size]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.max_running = max_running

    # ------------------------------------------------------------------ interface
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        cfg = self.loaded.config
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed % 2**64 if params.seed is not None else int(torch.seed()))
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop),
            kv=SequenceKVCache(
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.loaded.dtype, self.max_model_len
            ),
            generator=generator,
        )
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Forget a sequence (its client went away); no event is sent for it."""
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[GenerationEvent]:
        """Give each running sequence one forward pass; return the events they produced."""
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.scheduled_at = time.perf_counter()
            self.running.append(seq)
        events = []
        for seq in self.running:
            try:
                events.append(self._advance(seq))
            except Exception as exc:  # one sequence's failure never stops the engine
                log.exception("generation failed for %s", seq.request_id)
                seq.finish_reason = "error"
                events.append(
                    GenerationEvent(
                        seq.request_id, finished=True, error=f"generation failed: {type(exc).__name__}"
                    )
                )
        self.running = [s for s in self.running if not s.finished]
        return events

    # ------------------------------------------------------------------ internals
    def _forward(self, seq: Sequence, ids: list[int], start: int) -> torch.Tensor:
        seq.kv.begin(len(ids))
        hidden = self.model(torch.tensor(ids), torch.arange(start, start + len(ids)), seq.kv)
        seq.kv.commit()
        return hidden

    def _advance(self, seq: Sequence) -> GenerationEvent:
        prompt_logprobs = None
        params = seq.params
        if not seq.prefilled:
            if params.max_tokens == 0 and not params.prompt_logprobs:
                seq.finish_reason = "length"
                return self._event(seq, None)
            hidden = self._forward(seq, seq.prompt_ids, 0)
            seq.prefilled = True
            if params.prompt_logprobs:
                prompt_logprobs = self._score_prompt(seq, hidden)
            if params.max_tokens == 0:
                seq.finish_reason = "length"
                return self._event(seq, prompt_logprobs)
            last = hidden[-1:]
        else:
            position = len(seq.prompt_ids) + seq.num_generated - 1
            last = self._forward(seq, [seq.last_token], position)
        logits = self.model.logits(last)[0]
        self._sample(seq, logits)
        return self._event(seq, prompt_logprobs)

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
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        index = seq.num_generated
        seq.num_generated += 1
        seq.last_token = token
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
        if (
            seq.num_generated >= params.max_tokens
            or len(seq.prompt_ids) + seq.num_generated >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> list[TokenLogprob]:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        ids = seq.prompt_ids
        k = seq.params.logprobs or 0
        text = self.tokenizer.token_text
        out = [TokenLogprob(token_id=ids[0], text=text(ids[0]), logprob=None, top=None)]
        for start in range(0, len(ids) - 1, _LOGIT_CHUNK):
            rows = torch.log_softmax(
                self.model.logits(hidden[start : min(start + _LOGIT_CHUNK, len(ids) - 1)]), -1
            )
            for j in range(rows.shape[0]):
                tok = ids[start + j + 1]
                lp, top = sampler.token_logprobs(rows[j], tok, k)
                out.append(
                    TokenLogprob(
                        token_id=tok,
                        text=text(tok),
                        logprob=lp,
                        top=[(text(i), v) for i, v in top] if k else None,
                    )
                )
        return out

    def _event(self, seq: Sequence, prompt_logprobs: list[TokenLogprob] | None) -> GenerationEvent:
        text, first, last = seq.detokenizer.release(seq.finished)
        event = GenerationEvent(
            request_id=seq.request_id,
            text=text,
            token_ids=seq.output_ids[first:last],
            logprobs=seq.logprobs[first:last] if seq.params.logprobs is not None else [],
            prompt_logprobs=prompt_logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_generated_tokens=seq.num_generated,
            cumulative_logprob=seq.cumulative_logprob,
        )
        if seq.finished:
            now = time.perf_counter()
            scheduled = seq.scheduled_at or now
            first_token = seq.first_token_at or now
            event.queue_time = scheduled - seq.arrival
            event.prompt_time = max(0.0, first_token - scheduled)
            event.completion_time = max(0.0, now - first_token)
        return event
