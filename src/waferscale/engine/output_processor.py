"""From logits to what a client sees: grammar masks, sampling, logprobs, stop strings, finish checks and events.

A failure in one sequence's controls, grammar or logits ends that sequence only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from waferscale.engine import sampler
from waferscale.engine.errors import RequestError, internal_error
from waferscale.engine.faults import FaultHooks
from waferscale.engine.grammar import CALL_ROOTS, GrammarError, GrammarMasks, is_function_call
from waferscale.engine.metrics import Histogram
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.sequence import Sequence

log = logging.getLogger("waferscale.engine")


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_ids: list[int],
        grammars: GrammarMasks | None,
        native,
        max_model_len: int,
        logits: Callable[[torch.Tensor], torch.Tensor],
        release: Callable[[Sequence], None],
        faults: FaultHooks,
        max_draft: int = 8,
    ):
        self.tokenizer, self.eos_ids, self.grammars, self.native = tokenizer, eos_ids, grammars, native
        self.max_draft = max_draft  # the most speculative drafts a step (their count adapts up to it)
        self.speculative_drafts = self.speculative_accepted = 0
        self.max_model_len = max_model_len
        self.logits, self.release, self.faults = logits, release, faults
        self.generated_tokens = 0
        self.ttft = Histogram()  # arrival to first token
        self.itl = Histogram()  # between consecutive tokens of a sequence

    # ------------------------------------------------------------------ sampling
    def _grammar_masks(self, seqs: list[Sequence], events: list[GenerationEvent]) -> dict[int, torch.Tensor]:
        """Allowed-token bitmask rows of the grammar-constrained sequences (one batched call; the others pay
        nothing)."""
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
                    events.append(self.fail(seq, internal_error(exc)))
                    rows.append(None)
        return {id(s): r for s, r in zip(constrained, rows) if r is not None}

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[GenerationEvent]:
        """Sample the next token of every sequence from its row of `logits`, in one batched draw."""
        events: list[GenerationEvent] = []
        for seq, token, lp, top in self._pick(seqs, logits, events):
            if self._accept_or_fail(seq, token, lp, top, events):
                events.append(self.event(seq))
        return events

    def _accept_or_fail(
        self, seq: Sequence, token: int, lp: float, top, events: list[GenerationEvent]
    ) -> bool:
        """Accept a sampled token; a failure ends that sequence alone (its error event added). False if it failed."""
        try:
            self.accept(seq, token, lp, top)
        except Exception as exc:
            log.warning("sampling failed for %s: %s", seq.request_id, exc)
            events.append(self.fail(seq, internal_error(exc)))
            return False
        return True

    def verify(self, seq: Sequence, logits: torch.Tensor) -> list[GenerationEvent]:
        """Sample position by position over the rows of seq's last token and its drafts (its usual controls and
        grammar), accepting while the sampled token is the draft; the first other sample is still a correct one
        and is kept, the drafts after it are not."""
        events: list[GenerationEvent] = []
        drafts, accepted = seq.drafts, 0
        for j in range(len(drafts) + 1):
            picks = self._pick([seq], logits[j : j + 1], events)
            if not picks:
                break
            _, token, lp, top = picks[0]
            if not self._accept_or_fail(seq, token, lp, top, events):
                break
            hit = j < len(drafts) and token == drafts[j]
            accepted += hit
            if not hit or seq.finished:
                break
        if seq.params.prediction:  # the client's predicted output: reported in its usage
            seq.accepted_prediction_tokens += accepted
            seq.rejected_prediction_tokens += len(drafts) - accepted
        else:  # the server's own speculation: reported in /metrics
            self.speculative_drafts += len(drafts)
            self.speculative_accepted += accepted
            if seq.ngram is not None:
                seq.ngram.update(len(drafts), accepted, self.max_draft)
        if seq.error is None:
            events.append(self.event(seq))
        return events

    def _pick(
        self, seqs: list[Sequence], logits: torch.Tensor, events: list[GenerationEvent]
    ) -> list[tuple[Sequence, int, float, list[tuple[int, float]]]]:
        """The sampled token of each sequence with its logprob and top alternatives (failures go to `events`)."""
        masks = self._grammar_masks(seqs, events)
        # logprobs are of the model's own distribution (see docs/api.md): logit - logsumexp, without materialising
        # a whole log_softmax of the batch; a NaN anywhere in a row makes its logsumexp NaN
        if self.native is not None and logits.dtype == torch.float32:
            argmax, lse = self.native.argmax_logsumexp(logits)  # one pass over the rows, not torch's five
        else:
            argmax, lse = None, torch.logsumexp(logits, -1, keepdim=True)
        bad_rows = lse.squeeze(1).isnan().tolist()
        overrides: dict[int, torch.Tensor] = {}  # rows after penalties, bias, min_tokens or a grammar mask
        # greedy constrained rows, when the native kernels took the first argmax: their argmax among the allowed
        # tokens straight from the bitmask (row index, row after its controls, bitmask, whether controls applied)
        by_mask: list[tuple[int, torch.Tensor, torch.Tensor, bool]] = []
        rows: list[int] = []
        for i, seq in enumerate(seqs):
            params = seq.params
            if seq.finished:  # its grammar failed
                continue
            if params.max_tokens == 0:  # echo-only request: prompt scored, nothing to sample
                seq.finish_reason = "length"
                events.append(self.event(seq))
                continue
            try:
                self.faults.check_sample(seq.request_id, seq.num_generated)
                if bad_rows[i]:
                    raise FloatingPointError("the model produced NaN logits")
                bits = masks.get(id(seq))
                controls = sampler.needs_controls(params, seq.output_counts, seq.num_generated)
                if (
                    controls
                    and bits is None
                    and params.greedy
                    and argmax is not None
                    and argmax[i] not in self.eos_ids
                    and sampler.eos_mask_only(params, seq.output_counts)
                ):  # min_tokens masks only EOS, and this row's argmax is none: masking it changes no pick
                    controls = False
                if bits is not None and params.greedy and argmax is not None:
                    row = logits[i]
                    if controls:
                        row = row.clone()
                        sampler.apply_controls(row, params, seq.output_counts, self.eos_ids, seq.num_generated)
                    by_mask.append((i, row, bits, controls))
                elif bits is not None or controls:
                    row = logits[i].clone()
                    sampler.apply_controls(row, params, seq.output_counts, self.eos_ids, seq.num_generated)
                    if bits is not None:
                        mask = self.grammars.allowed(bits)
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
                events.append(self.fail(seq, internal_error(exc)))
                continue
            rows.append(i)
        if by_mask:
            argmax = list(argmax)
            picks = self.native.masked_argmax(
                torch.stack([r for _, r, _, _ in by_mask]), torch.stack([b for _, _, b, _ in by_mask])
            )
            for (i, _, bits, controls), token in zip(by_mask, picks):
                if token < 0 and controls:  # min_tokens or logit_bias left nothing the grammar allows: it wins
                    token = self.native.masked_argmax(logits[i : i + 1], bits.unsqueeze(0))[0]
                if token < 0:
                    exc = GrammarError("the grammar allows no token here")
                    log.warning("sampling failed for %s: %s", seqs[i].request_id, exc)
                    events.append(self.fail(seqs[i], internal_error(exc)))
                    rows.remove(i)
                else:
                    argmax[i] = token
        if not rows:
            return []
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
        out = []
        for j, (seq, token) in enumerate(zip(picked, tokens)):
            k = seq.params.logprobs or 0
            top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else []
            out.append((seq, token, chosen[j], top))
        return out

    # ------------------------------------------------------------------ finish checks
    def accept(self, seq: Sequence, token: int, lp: float, top: list[tuple[int, float]]) -> None:
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
                    top=[(i, self.tokenizer.token_text(i), v) for i, v in top] if params.logprobs else None,
                    offset=len(seq.detokenizer.text),
                )
            )
        if index < params.min_tokens:  # stop strings do not count yet, nor cut the text
            seq.detokenizer.add(token, check_stops=False)
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

    def score_prompt(self, seq: Sequence, hidden: torch.Tensor, first_pos: int) -> None:
        """Logprob of each prompt token given the ones before it (the first has none)."""
        ids = seq.prompt_ids
        k = seq.params.logprobs or 0
        text = self.tokenizer.token_text
        if first_pos == 0:
            seq.prompt_logprobs = [TokenLogprob(token_id=ids[0], text=text(ids[0]), logprob=None, top=None)]
        count = min(hidden.shape[0], len(ids) - 1 - first_pos)
        if count <= 0:
            return
        rows = torch.log_softmax(self.logits(hidden[:count]), -1)
        for j in range(count):
            tok = ids[first_pos + j + 1]
            lp, top = sampler.token_logprobs(rows[j], tok, k)
            seq.prompt_logprobs.append(
                TokenLogprob(tok, text(tok), lp, [(i, text(i), v) for i, v in top] if k else None)
            )

    # ------------------------------------------------------------------ events
    def fail(self, seq: Sequence, error: RequestError) -> GenerationEvent:
        """End a sequence with an error; its blocks are freed."""
        seq.fail(error)
        return self.event(seq)

    def event(self, seq: Sequence) -> GenerationEvent:
        if seq.error is not None:
            event = GenerationEvent(seq.request_id, finished=True, error=seq.error)
        else:
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
                accepted_prediction_tokens=seq.accepted_prediction_tokens,
                rejected_prediction_tokens=seq.rejected_prediction_tokens,
            )
        if seq.finished:
            self.release(seq)
            self.faults.fail_after.pop(seq.request_id, None)
            now = time.perf_counter()
            scheduled = seq.scheduled_at or now
            first_token = seq.first_token_at or now
            event.queue_time = scheduled - seq.arrival
            event.prompt_time = max(0.0, first_token - scheduled)
            event.completion_time = max(0.0, now - first_token)
        return event
