"""Speculative decoding (n-gram, and a draft model's) against none, in-process, servers' engines alternated task by task.

Usage: .venv/bin/python scripts/bench_speculation.py [--model PATH] [--dtype bfloat16] [--tokens 128] [--streams 1]
           [--draft-model PATH|self:int4|self:int8]
For each task of scripts/data/spec_tasks.json (input-grounded ones, whose answers copy from the prompt, and
open-ended ones), greedy, as a chat turn through the model's template: output tokens/s with --speculative ngram (and
draft, with --draft-model) and none, over the whole request and over decoding alone (after the first token, as
llama-server's predicted_per_second: speculation cannot shorten the prompt's prefill), whether the outputs are identical, and each method's acceptance (drafts
accepted of those proposed, and output tokens per target forward). --streams N runs N copies of each task at once
(as N concurrent clients). On a shared machine, read only the ratios, which come from interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale.engine import LLMEngine, SamplingParams  # noqa: E402
from waferscale.engine.build import _load_draft  # noqa: E402
from waferscale.engine.settings import EngineSettings  # noqa: E402
from waferscale.engine.speculation import SpeculativeConfig  # noqa: E402
from waferscale.models import load_model  # noqa: E402
from waferscale.models.chat_template import ChatTemplate  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, float, int, int]:
    """Outputs, seconds (all; and after every prompt's first token: decoding only, as llama-server's
    predicted_per_second counts), output tokens and engine steps of the prompts decoded together."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=tokens, temperature=0))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    start, steps, first = time.perf_counter(), 0, None
    while engine.has_work():
        steps += 1
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
        if first is None and all(out.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    outs = [out[str(i)] for i in range(len(prompts))]
    return outs, end - start, end - (first or end), sum(len(v) for v in out.values()), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--draft-model", help="also measure --speculative draft with this draft model")
    args = ap.parse_args()
    tasks = json.loads((Path(__file__).with_name("data") / "spec_tasks.json").read_text())
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    methods = ["none", "ngram"] + (["draft"] if args.draft_model else [])
    draft = None
    if args.draft_model:
        settings = EngineSettings(
            model=args.model, dtype=args.dtype, speculative="draft", draft_model=args.draft_model
        )
        draft = _load_draft(settings, loaded)
    engines = {
        m: LLMEngine(loaded, speculative=SpeculativeConfig(m), draft=draft if m == "draft" else None)
        for m in methods
    }

    def encode(text: str) -> list[int]:
        return loaded.tokenizer.encode(template.render([{"role": "user", "content": text}]))

    for m in methods:  # warm-up
        run(engines[m], [encode("Hello")], 4)
    for kind in ("grounded", "open"):
        rates: dict[str, list[float]] = {m: [] for m in methods}
        ratios: dict[str, list[float]] = {m: [] for m in methods[1:]}
        decode_rates: dict[str, list[float]] = {m: [] for m in methods}  # after the first token (prompt excluded)
        decode_ratios: dict[str, list[float]] = {m: [] for m in methods[1:]}
        same = dict.fromkeys(methods[1:], True)
        before = {m: engines[m].stats() for m in methods}
        tokens = dict.fromkeys(methods, 0)
        steps = dict.fromkeys(methods, 0)
        for text in tasks[kind]:
            prompts = [encode(text)] * args.streams
            outs = {}
            for method in methods:
                outs[method], secs, decoding, n, k = run(engines[method], prompts, args.tokens)
                rates[method].append(n / secs)
                decode_rates[method].append((n - len(prompts)) / decoding if decoding > 0 else 0.0)
                tokens[method] += n
                steps[method] += k
            for method in methods[1:]:
                same[method] &= outs["none"] == outs[method]
                ratios[method].append(rates[method][-1] / rates["none"][-1])
                decode_ratios[method].append(decode_rates[method][-1] / decode_rates["none"][-1])
        print(
            f"{kind:9s} streams={args.streams}: none {statistics.median(rates['none']):6.1f} tok/s "
            f"({statistics.median(decode_rates['none']):.1f} decoding, prompt excluded)"
        )
        for method in methods[1:]:
            after = engines[method].stats()
            drafts = after.speculative_draft_tokens - before[method].speculative_draft_tokens
            accepted = after.speculative_accepted_tokens - before[method].speculative_accepted_tokens
            print(
                f"  {method:5s} {statistics.median(rates[method]):6.1f} tok/s, ratio median "
                f"{statistics.median(ratios[method]):.2f} (min {min(ratios[method]):.2f}); decoding "
                f"{statistics.median(decode_rates[method]):.1f} tok/s, ratio median "
                f"{statistics.median(decode_ratios[method]):.2f} (min {min(decode_ratios[method]):.2f}); identical outputs: "
                f"{same[method]}; accepted {accepted} of {drafts} drafts ({accepted / max(drafts, 1):.0%}), "
                f"{tokens[method] / steps[method]:.2f} output tokens a step (none: "
                f"{tokens['none'] / steps['none']:.2f})"
            )


if __name__ == "__main__":
    main()
