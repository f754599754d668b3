"""Cost of grammar-constrained decoding: decode tokens/s of constrained against unconstrained streams, same run.

Usage: .venv/bin/python scripts/bench_grammar.py [--dtype bfloat16] [--tokens 128] [--runs 3]
Prints single-stream decode tok/s with and without `grammar_root`, and the aggregate at concurrency 8 with half the
streams constrained against all eight unconstrained. Greedy decoding, in-process engine (no HTTP).
"""

from __future__ import annotations

import argparse
import statistics
import time

# a long JSON array the model keeps extending: `insidevalue` continues it, the free run sees the same prompt
PROMPT = "The first hundred prime numbers, as a JSON array: [2, 3, 5, 7, 11, 13, 17, 19, 23, "


def decode_rate(engine, grammars: list[str | None], tokens: int) -> float:
    """Generated tokens per second over the decode phase of len(grammars) concurrent greedy streams."""
    from waferscale.engine import SamplingParams

    ids = engine.tokenizer.encode(PROMPT)
    for i, g in enumerate(grammars):
        params = SamplingParams(max_tokens=tokens, temperature=0, grammar=g, min_tokens=0 if g else tokens)
        engine.add_request(f"s{i}", ids, params)
    while engine.waiting or any(s.num_generated == 0 for s in engine.running):
        engine.step()  # prefill (and the first token) is not decode
    start, generated = time.perf_counter(), 0
    while engine.has_work():
        generated += sum(ev.num_generated_tokens - 1 for ev in engine.step() if ev.finished)
    return generated / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    from waferscale.engine import LLMEngine
    from waferscale.models import load_model

    engine = LLMEngine(load_model(args.model, dtype=args.dtype, progress=False), enable_prefix_cache=False)
    decode_rate(engine, ["insidevalue", None], 8)  # warm-up, grammar compiled

    def median(grammars: list[str | None]) -> float:
        return statistics.median(decode_rate(engine, grammars, args.tokens) for _ in range(args.runs))

    rows = [
        ("1 stream, unconstrained", median([None])),
        ("1 stream, grammar_root=insidevalue", median(["insidevalue"])),
        ("8 streams, unconstrained", median([None] * 8)),
        ("8 streams, 4 constrained", median(["insidevalue", None] * 4)),
    ]
    print(f"| scenario ({args.dtype}, greedy, {args.tokens} tokens) | decode tok/s | vs unconstrained |")
    print("|---|---|---|")
    for i, (name, rate) in enumerate(rows):
        base = rows[i - i % 2][1]
        print(f"| {name} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
