"""Speculative decoding by a draft model: a small model (or the target's own weights quantized, `self:int4`) proposes
each decoding sequence's next tokens by greedy decoding, and the target verifies them in its next step as it does
n-gram drafts (engine/output_processor.verify), so the output stays exactly the target's.

The draft runs in the engine's thread with a KV pool and blocks of its own. Each step, before the target's
schedule: every sequence the draft proposes for first catches its draft KV up with the tokens the target accepted
(the positions of rejected drafts are simply written again), in one forward for the whole batch, then the draft
decodes its k tokens with one forward a position for all of them. The number of drafts adapts per sequence
(speculation.AdaptiveK), as for n-gram, and goes no further than pays for the target's rows (its table of a step's
time by rows) and for the draft forwards (a one-row draft forward, timed at start): a draft as costly as its target
makes none. A step with more sequences decoding than SpeculativeConfig.max_seqs does not speculate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from waferscale import kernels
from waferscale.engine.block_manager import BlockManager
from waferscale.engine.kv_cache import KVPool, kv_cache_dtypes
from waferscale.engine.model_runner import ModelRunner
from waferscale.engine.params import SamplingParams
from waferscale.engine.scheduler import ScheduledBatch
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import AdaptiveK, RowCosts, SpeculativeConfig, StepLoad
from waferscale.models.loader import LoadedModel
from waferscale.models.source import ModelLoadError

log = logging.getLogger("waferscale.engine")
SELF_PREFIX = "self:"  # --draft-model self:int4: the target's own weights, quantized
SELF_QUANTIZATIONS = ("int4", "int8")
DRAFT_KV_FRACTION = 4  # the draft's KV pool is a quarter of the target's unless set
_NO_SCORES = SamplingParams(max_tokens=1)  # what the runner reads of a draft row's params: no prompt logprobs
# a draft model is chosen to agree with its target: a sequence's estimate of its acceptance starts at 4 in 5 (drafts
# cost draft forwards, so at n-gram's 1 in 2 a costly draft would never be tried), then follows its verifications
PRIOR_ACCEPTED, PRIOR_REJECTED = 4.0, 1.0
PRIOR = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)


@dataclass(eq=False)
class DraftSeq:
    """One sequence as the draft model sees it: the tokens its draft KV holds (and the proposal being decoded), its
    draft blocks, the proposal offered to the target and how much of it the target took, and its draft count.

    Shaped as the model runner reads a Sequence (token_ids, num_computed, block_tables, dropped, drafts, params)."""

    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose draft keys and values are in the draft pool
    block_tables: list[list[int]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # always empty: the draft runs plain rows
    params: SamplingParams = field(default_factory=lambda: _NO_SCORES)
    prompt_logprobs_sent: bool = True
    proposal: list[int] = field(default_factory=list)
    base: int = 0  # the target's token count when the proposal was made
    taken: int = 0  # proposal tokens the target's scheduler took for verification
    adapt: AdaptiveK = field(default_factory=lambda: AdaptiveK(accepted=PRIOR_ACCEPTED, rejected=PRIOR_REJECTED))

    def take(self, k: int) -> list[int]:
        """The proposal's first k tokens, for the target to verify in this step."""
        drafts = self.proposal[:k]
        self.taken = len(drafts)
        return drafts


def self_quantization(draft_model: str) -> str | None:
    """The quantization of a `self:int4`-style draft (the target's weights again), None for a model path or name.
    Raises ValueError for an unknown one."""
    if not draft_model.startswith(SELF_PREFIX):
        return None
    q = draft_model[len(SELF_PREFIX) :]
    if q not in SELF_QUANTIZATIONS:
        raise ValueError(
            f"draft model {draft_model!r}: choose self:int4 or self:int8 (the target's weights quantized), or a "
            "GGUF file, a Hugging Face folder or a built-in model name"
        )
    return q


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer maps text to other ids than the target's: its proposals would mean other
    tokens. Raises ModelLoadError saying what differs and what to change."""
    t_vocab = target.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    d_vocab = draft.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    if t_vocab == d_vocab:
        return
    differs = []
    if len(t_vocab) != len(d_vocab):
        differs.append(f"{len(d_vocab)} tokens against the target's {len(t_vocab)}")
    examples = []
    for token, i in sorted(t_vocab.items(), key=lambda kv: kv[1]):
        j = d_vocab.get(token)
        if j != i:
            examples.append(f"{token!r} is {i} in the target, {'absent' if j is None else j} in the draft")
            if len(examples) == 2:
                break
    if not examples:  # the draft has tokens the target lacks
        extra = sorted(set(d_vocab) - set(t_vocab), key=lambda t: d_vocab[t])[:2]
        examples = [f"{t!r} ({d_vocab[t]}) is only in the draft" for t in extra]
    differs += examples
    raise ModelLoadError(
        f"the draft model {draft.name} has another tokenizer than {target.name} ({'; '.join(differs)}): give "
        "--draft-model a model with the same tokenizer (a smaller model of the same family, or self:int4), or "
        "use --speculative ngram"
    )


class DraftModel:
    """A draft model with its own KV pool, proposing tokens for the target's decoding sequences."""

    def __init__(
        self,
        loaded: LoadedModel,
        speculative: SpeculativeConfig,
        *,
        kv_cache_bytes: int,
        block_size: int = 16,
        max_batched_tokens: int = 512,
    ):
        self.loaded, self.speculative = loaded, speculative
        self.model = loaded.model
        cfg = loaded.config
        kv_dtype, compute_dtype = kv_cache_dtypes("auto", loaded.dtype)
        native = kernels.load() if kv_dtype in (torch.float32, torch.bfloat16) else None
        self.pool = KVPool.for_model(cfg, kv_dtype, compute_dtype, block_size, kv_cache_bytes)
        num_pages, kinds, per_page = self.pool.num_blocks, self.pool.layout.block_kinds, self.pool.page_bytes
        self.blocks = BlockManager(num_pages, block_size, False, kinds)
        self.runner = ModelRunner(self.model, self.pool, native, self.blocks, rows_upto=speculative.max_draft + 1)
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens  # draft KV caught up a step, over all sequences
        self.tracked: dict[int, Sequence] = {}  # sequences holding draft blocks
        self.forwards = 0
        self.token_seconds = 0.0  # a one-row draft forward's time (set at start): what each draft costs to make
        log.info(
            "draft model %s (%s, weights: %s): KV cache %d MiB, %d tokens",
            loaded.name,
            str(loaded.dtype).removeprefix("torch."),
            loaded.quantization,
            num_pages * per_page >> 20,
            (num_pages - 1) // sum(k.pages for k in kinds) * block_size,
        )

    # ------------------------------------------------------------------ one step
    def prepare(self, running: list[Sequence], max_model_len: int, costs: RowCosts | None = None) -> None:
        """Propose the next tokens of every decoding sequence that speculates this step (left in seq.draft.proposal
        for drafts.draft_tokens), each no more than pay for their rows in the target's step (costs) and for the
        draft forwards that make them."""
        self.retire(running)
        decoding = [s for s in running if not s.finished and s.remaining == 1 and s.num_generated]
        for seq in decoding:
            if seq.draft is not None:
                self._settle(seq)
        if len(decoding) > self.speculative.max_seqs:
            return
        wanted: list[tuple[Sequence, int]] = []
        for seq in decoding:
            if seq.params.prediction:  # the client's predicted output proposes instead
                continue
            state = seq.draft
            if state is None:
                state = seq.draft = DraftSeq(dropped=[0] * len(self.blocks.kinds))
                state.block_tables = [[] for _ in self.blocks.kinds]
                self.tracked[id(seq)] = seq
            if state.adapt.paused():
                continue
            k = min(
                state.adapt.k,
                self.speculative.max_draft,
                seq.params.max_tokens - seq.num_generated - 1,
                max_model_len - len(seq.token_ids),
                self.loaded.max_model_len - len(seq.token_ids),
            )
            if k > 0:
                wanted.append((seq, k))
        if wanted and costs is not None:
            wanted = self._paying(wanted, costs, StepLoad(len(decoding), len(decoding)))
        if wanted:
            self._propose(wanted, decoding)

    def _paying(
        self, wanted: list[tuple[Sequence, int]], costs: RowCosts, step: StepLoad
    ) -> list[tuple[Sequence, int]]:
        """The drafts that pay for their rows in the target's step and for the draft forwards that make them (one
        forward a draft position for every sequence): as many forwards as give the step the most tokens a second.
        Where none pays but some would at the prior's acceptance, a sequence still tries one now and then
        (AdaptiveK.probe)."""
        each = [(k, seq.draft.adapt.acceptance()) for seq, k in wanted]
        forwards = costs.shared_k(each, step, self.token_seconds)
        could = forwards > 0 or costs.shared_k([(k, PRIOR) for k, _ in each], step, self.token_seconds) > 0
        paying = [(seq, seq.draft.adapt.probe(min(k, forwards), could)) for seq, k in wanted]
        return [(seq, k) for seq, k in paying if k > 0]

    def retire(self, running: list[Sequence]) -> None:
        """Free the draft blocks of sequences that finished or left the running batch (preempted, aborted)."""
        self._forget([s for s in self.tracked.values() if s.finished or s not in running])

    def _settle(self, seq: Sequence) -> None:
        """Adapt seq's draft count to the verification of its last proposal (if the target ran it)."""
        state = seq.draft
        if state.taken and len(seq.token_ids) > state.base:
            verified = seq.token_ids[state.base : state.base + state.taken]
            accepted = 0
            while accepted < len(verified) and verified[accepted] == state.proposal[accepted]:
                accepted += 1
            state.adapt.update(state.taken, accepted, self.speculative.max_draft)
        state.proposal, state.taken = [], 0

    def _sync(self, seq: Sequence) -> int:
        """Point seq's draft at the target's tokens, keeping the draft KV of the longest common prefix; the number of
        tokens the draft must still run (at least the last one, whose next token it proposes)."""
        state, tokens = seq.draft, seq.token_ids
        n = min(state.num_computed, len(tokens) - 1)
        start = min(n, state.base)  # up to its base the draft held the target's own tokens
        same = start
        while same < n and state.token_ids[same] == tokens[same]:
            same += 1
        state.token_ids, state.num_computed = list(tokens), same
        return len(tokens) - same

    def _blocks_for(self, state: DraftSeq, num_tokens: int) -> bool:
        """Grow the draft's tables to hold num_tokens; False if the draft pool has no room."""
        need = -(-num_tokens // self.block_size)
        pages = sum(
            max(0, need - len(t)) * kind.pages for t, kind in zip(state.block_tables, self.blocks.kinds)
        )
        if pages > self.blocks.num_available:
            return False
        for k, table in enumerate(state.block_tables):
            table += [self.blocks.allocate(k) for _ in range(need - len(table))]
        return True

    def _propose(self, wanted: list[tuple[Sequence, int]], decoding: list[Sequence]) -> None:
        """Catch every draft up in one forward (its first proposal from the last row), then one forward a position
        for the rest of the proposals, all sequences together."""
        budget = self.max_batched_tokens
        prefills: list[tuple[DraftSeq, int]] = []
        ks: dict[int, int] = {}
        for seq, k in wanted:
            behind = self._sync(seq)
            state = seq.draft
            if not self._blocks_for(state, len(state.token_ids) + k - 1):
                self._forget([s for s in list(self.tracked.values()) if s not in decoding])  # idle ones' room
                if not self._blocks_for(state, len(state.token_ids) + k - 1):
                    continue  # no room in the draft pool: this sequence goes without drafts
            chunk = min(behind, budget)
            if chunk <= 0:
                break
            budget -= chunk
            state.base = len(seq.token_ids)
            prefills.append((state, chunk))
            if chunk == behind:
                ks[id(state)] = k
        if not prefills:
            return
        active = self._forward(ScheduledBatch(prefills=prefills))  # those still catching up sample nothing
        eos = set(self.loaded.tokenizer.eos_token_ids)
        while True:
            active = [s for s in active if len(s.proposal) < ks[id(s)] and s.proposal[-1] not in eos]
            if not active:
                return
            self._forward(ScheduledBatch(decodes=active))

    def _forward(self, batch: ScheduledBatch) -> list[DraftSeq]:
        """Run the draft on a batch and append each sampled row's greedy token to its sequence's proposal."""
        out = self.runner.forward(batch)
        self.forwards += 1
        for state in batch.decodes:
            state.num_computed += 1
        for state, chunk in batch.prefills:
            state.num_computed += chunk
        if not out.sample_rows:
            return []
        logits = self.runner.logits(out.hidden[[r for _, r in out.sample_rows]])
        states = []
        for (state, _), token in zip(out.sample_rows, torch.argmax(logits, -1).tolist()):
            state.token_ids.append(token)
            state.proposal.append(token)
            states.append(state)
        return states

    def _forget(self, seqs: list[Sequence]) -> None:
        """Free these sequences' draft blocks (they finished, left the running batch, or make room)."""
        for seq in seqs:
            if seq.draft is not None:
                for table in seq.draft.block_tables:
                    self.blocks.release(table)
                seq.draft = None
            self.tracked.pop(id(seq), None)
