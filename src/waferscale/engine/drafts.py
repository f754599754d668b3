"""The draft tokens a decoding sequence verifies in its step: its client's predicted output where it sent one, else
the server's own speculation (when the step is small enough for it to pay): n-gram lookup, or what the draft model
proposed before the step (engine/draft_model.py)."""

from __future__ import annotations

from waferscale.engine.prediction import MAX_DRAFT, propose
from waferscale.engine.sequence import Sequence
from waferscale.engine.speculation import NgramState, RowCosts, SpeculativeConfig, StepLoad


def draft_tokens(
    seq: Sequence,
    budget: int,
    max_model_len: int,
    speculative: SpeculativeConfig,
    speculate: bool,
    costs: RowCosts | None = None,
    step: StepLoad | None = None,
) -> list[int]:
    """Drafts to run after seq's last token, within the step's token budget, max_tokens and the context; of the
    server's own, no more than pay for their rows in the step (costs; step counts them in)."""
    limit = min(budget, seq.params.max_tokens - seq.num_generated - 1, max_model_len - len(seq.token_ids))
    if seq.params.prediction:
        drafts, seq.prediction_anchor = propose(
            seq.params.prediction, seq.output_ids, seq.prediction_anchor, min(MAX_DRAFT, limit)
        )
        return drafts
    k = min(speculative.max_draft, limit)
    if not speculate or k <= 0:
        return []
    if speculative.method == "draft" and seq.draft is None:
        return []
    if speculative.method != "draft" and seq.ngram is None:
        seq.ngram = NgramState()
    adapt = seq.draft.adapt if speculative.method == "draft" else seq.ngram
    if costs is not None and step is not None:
        k = costs.best_k(adapt.acceptance(), k, step)
    drafts = seq.draft.take(k) if speculative.method == "draft" else seq.ngram.propose(seq.token_ids, k)
    if drafts and seq.matcher is not None:
        # up to the first draft the grammar forbids: verification would reject it (the masked sample never equals
        # it), so its row and those after it would only cost compute
        drafts = drafts[: seq.matcher.validate_tokens(drafts)]
    if step is not None:
        step.add(len(drafts), adapt.acceptance())
    return drafts
