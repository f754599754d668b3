"""How far n-gram speculation can take a model on the speculation tasks: its own drafting replayed on the model's
greedy outputs, against the ceiling of any proposer that copies from the context.

Usage: .venv/bin/python scripts/spec_ceiling.py [--model PATH|NAME] [--dtype bfloat16] [--tokens 96]
Greedy decoding's output is the same with speculation and without (engine/output_processor.verify), so once a task's
output is known, a proposer's drafts, its accepted counts and its steps can be replayed without the model. Each
step is timed by the engine's own table of a decoding step's time by rows (engine/row_costs.py, measured at start on
this machine), so a gain here is decoding's (first token excluded, as llama-server's predicted_per_second):
- `ngram`: the engine's n-gram drafting for one stream (speculation.NgramState, AdaptiveK and RowCosts.best_k, as
  engine/drafts.py calls them);
- `copy` (a ceiling): a proposer told the output, whose drafts are the longest run of the output's next tokens that
  follows an earlier occurrence of the last token anywhere in the prompt or the output, never a rejected draft, as
  many as pay for their rows;
- `copy, rows free` (a ceiling of the ceiling): the same drafts with every step costing a one-row step's time.
No lookup proposer can do better than `copy` on these outputs on this machine: where it stays below a target, the
target needs other drafts (a draft model) or outputs that copy more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale.engine import LLMEngine, SamplingParams  # noqa: E402
from waferscale.engine.speculation import NgramState, RowCosts, SpeculativeConfig, StepLoad  # noqa: E402
from waferscale.models import load_model  # noqa: E402
from waferscale.models.chat_template import ChatTemplate  # noqa: E402


def greedy(engine: LLMEngine, prompt: list[int], tokens: int) -> list[int]:
    """The prompt's greedy output of up to `tokens` tokens."""
    engine.add_request("task", prompt, SamplingParams(max_tokens=tokens, temperature=0))
    out: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids
    return out


def copy_run(context: list[int], truth: list[int]) -> int:
    """The most of truth's first tokens that follow an earlier occurrence of context's last token in context."""
    best, last = 0, context[-1]
    for j in range(1, len(context)):
        if context[j - 1] != last:
            continue
        n = 0
        while n < len(truth) and j + n < len(context) and context[j + n] == truth[n]:
            n += 1
        best = max(best, n)
    return best


def replay(
    prompt: list[int], out: list[int], costs: RowCosts, proposer: str, most: int
) -> tuple[float, int, int]:
    """Decoding's modeled gain over no drafts (a step's time from costs), drafts accepted and proposed."""
    state, p, seconds, accepted, proposed = NgramState(), 1, 0.0, 0, 0
    while p < len(out):
        limit = min(most, len(out) - p - 1)  # as draft_tokens: max_tokens - generated - 1
        context = prompt + out[:p]
        if proposer == "ngram":
            k = costs.best_k(state.acceptance(), limit, StepLoad(1, 1.0)) if limit > 0 else 0
            drafts = state.propose(context, k) if k > 0 else []
        else:  # the longest copy that can be right, cut to what pays best for its rows
            run = min(copy_run(context, out[p:]), limit)
            k = max(range(run + 1), key=lambda n: (1 + n) / costs.at(1 + n))
            drafts = out[p : p + k]
        a = 0
        while a < len(drafts) and drafts[a] == out[p + a]:
            a += 1
        if drafts:
            state.update(len(drafts), a, most)
        accepted, proposed = accepted + a, proposed + len(drafts)
        seconds += costs.at(1 + len(drafts))
        p += a + 1
    return (len(out) - 1) * costs.at(1) / seconds if seconds else 1.0, accepted, proposed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    tasks = json.loads((Path(__file__).with_name("data") / "spec_tasks.json").read_text())
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    config = SpeculativeConfig("ngram")
    costs = LLMEngine(loaded, speculative=config).scheduler.row_costs
    flat = RowCosts(dict.fromkeys(costs.seconds, costs.at(1)))
    engine = LLMEngine(loaded, speculative=SpeculativeConfig("none"))
    print(f"a decoding step's time by rows, against one row's: {costs.describe()}")
    for kind in ("grounded", "open"):
        outputs = []
        for text in tasks[kind]:
            prompt = loaded.tokenizer.encode(template.render([{"role": "user", "content": text}]))
            outputs.append((prompt, greedy(engine, prompt, args.tokens)))
        print(f"{kind}: output tokens {[len(o) for _, o in outputs]}")
        for label, proposer, table in (
            ("ngram", "ngram", costs),
            ("copy", "copy", costs),
            ("copy, rows free", "copy", flat),
        ):
            runs = [replay(prompt, out, table, proposer, config.max_draft) for prompt, out in outputs]
            each = " ".join(f"{g:.2f} ({a}/{n})" for g, a, n in runs)
            print(f"  {label:16s} median {statistics.median(g for g, _, _ in runs):.2f}x none; tasks: {each}")


if __name__ == "__main__":
    main()
