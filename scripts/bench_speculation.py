"""Speculative decoding (n-gram) against none, in-process, servers' engines alternated task by task.

Usage: .venv/bin/python scripts/bench_speculation.py [--model PATH] [--dtype bfloat16] [--tokens 128] [--streams 1]
For each task of scripts/data/spec_tasks.json (input-grounded ones, whose answers copy from the prompt, and
open-ended ones), greedy, as a chat turn through the model's template: output tokens/s with --speculative ngram and
none, and whether the outputs are identical. --streams N runs N copies of each task at once (as N concurrent
clients). On a shared machine, read only the ratios, which come from interleaved runs.
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
from waferscale.engine.speculation import SpeculativeConfig  # noqa: E402
from waferscale.models import load_model  # noqa: E402
from waferscale.models.chat_template import ChatTemplate  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, int]:
    """Outputs, seconds and output tokens of the prompts decoded together."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=tokens, temperature=0))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    start = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
    elapsed = time.perf_counter() - start
    return [out[str(i)] for i in range(len(prompts))], elapsed, sum(len(v) for v in out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=1)
    args = ap.parse_args()
    tasks = json.loads((Path(__file__).with_name("data") / "spec_tasks.json").read_text())
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    engines = {m: LLMEngine(loaded, speculative=SpeculativeConfig(m)) for m in ("none", "ngram")}

    def encode(text: str) -> list[int]:
        return loaded.tokenizer.encode(template.render([{"role": "user", "content": text}]))

    run(engines["none"], [encode("Hello")], 4)  # warm-up
    run(engines["ngram"], [encode("Hello")], 4)
    for kind in ("grounded", "open"):
        ratios, same = [], True
        rates = {"none": [], "ngram": []}
        for text in tasks[kind]:
            prompts = [encode(text)] * args.streams
            outs = {}
            for method in ("none", "ngram"):
                outs[method], secs, n = run(engines[method], prompts, args.tokens)
                rates[method].append(n / secs)
            same &= outs["none"] == outs["ngram"]
            ratios.append(rates["ngram"][-1] / rates["none"][-1])
        print(
            f"{kind:9s} streams={args.streams}: none {statistics.median(rates['none']):6.1f} tok/s, ngram "
            f"{statistics.median(rates['ngram']):6.1f} tok/s, ratio median {statistics.median(ratios):.2f} "
            f"(min {min(ratios):.2f}), identical outputs: {same}"
        )
    stats = engines["ngram"].stats()
    print(f"drafts {stats.speculative_draft_tokens}, accepted {stats.speculative_accepted_tokens}")


if __name__ == "__main__":
    main()
