"""Predicted outputs: single-stream decode tokens/s with a correct prediction against none (in-process, greedy).

Usage: .venv/bin/python scripts/bench_prediction.py [--model PATH] [--dtype bfloat16] [--tokens 128] [--runs 3]
The prediction is the greedy output itself (the best case: an edit that changes nothing); each figure is the
median of --runs runs, the prompt served from the prefix cache after the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT = (
    "Rewrite this function so that it also accepts lists:\n\ndef total(a, b):\n    return a + b\n\nAnswer:"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    from waferscale.engine import LLMEngine, SamplingParams
    from waferscale.models import load_model

    engine = LLMEngine(load_model(args.model, dtype=args.dtype, progress=False))
    ids = engine.tokenizer.encode(PROMPT)

    def run(prediction):
        params = SamplingParams(args.tokens, min_tokens=args.tokens, temperature=0, prediction=prediction)
        engine.add_request("b", ids, params)
        out, steps, last, first_at = [], 0, None, None
        while engine.has_work():
            steps += 1
            for ev in engine.step():
                out += ev.token_ids
                if first_at is None and ev.token_ids:
                    first_at = (
                        time.perf_counter()
                    )  # decode timing starts at the first token (prefill excluded)
                last = ev
        elapsed = time.perf_counter() - first_at
        return out, (last.num_generated_tokens - 1) / elapsed, steps, last

    greedy, _, _, _ = run(None)  # warm-up, and the prediction
    plain = [run(None) for _ in range(args.runs)]
    predicted = [run(greedy) for _ in range(args.runs)]
    assert all(r[0] == greedy for r in plain), "greedy output changed between runs"
    same = [r[0] == greedy for r in predicted]
    first_diff = next((i for i, (a, b) in enumerate(zip(predicted[0][0], greedy)) if a != b), None)
    rate = statistics.median(r[1] for r in plain)
    rate_p = statistics.median(r[1] for r in predicted)
    ev = predicted[-1][3]
    print(f"{'':24}{'tokens/s':>10}{'steps':>8}")
    print(f"{'no prediction':24}{rate:10.1f}{plain[-1][2]:8d}")
    print(f"{'correct prediction':24}{rate_p:10.1f}{predicted[-1][2]:8d}")
    print(
        f"speed-up x{rate_p / rate:.2f}; drafts accepted {ev.accepted_prediction_tokens}, "
        f"rejected {ev.rejected_prediction_tokens} ({args.tokens} tokens, {args.dtype})"
    )
    # verified drafts go through the prefill path, several rows at once: in float32 the answer is the same; in
    # bfloat16 a near-tie may resolve otherwise, as it may between batch sizes (README, native kernels)
    print(
        f"same output as without a prediction: {sum(same)}/{len(same)} runs"
        + (f" (first difference at token {first_diff})" if first_diff is not None else "")
    )


if __name__ == "__main__":
    main()
