"""Single-stream engine figures: cold/warm start to first token, decode tokens/s, prefill tokens/s.

Usage: .venv/bin/python scripts/bench_engine.py [--model PATH] [--dtypes bfloat16,float32] [--runs 3]
Prints one table; each figure is the median of --runs runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def start_to_first_token(model: str | None, dtype: str, cache_dir: str) -> float:
    """Wall seconds for `waferscale complete` to load the model and print one token, as a fresh process."""
    cmd = [sys.executable, "-m", "waferscale", "complete", "Hello", "--max-tokens", "1", "--dtype", dtype]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    subprocess.run(
        cmd, check=True, capture_output=True, env={**os.environ, "WAFERSCALE_CACHE_DIR": cache_dir}
    )
    return time.perf_counter() - t0


def engine_rates(model: str | None, dtype: str, runs: int) -> tuple[float, float]:
    from waferscale.engine import LLMEngine, SamplingParams
    from waferscale.models import load_model

    loaded = load_model(model, dtype=dtype, progress=False)
    engine = LLMEngine(loaded, enable_prefix_cache=False)  # every run computes its whole prompt

    def run(ids, max_tokens, min_tokens=0):
        engine.add_request(
            "b", ids, SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0)
        )
        last = None
        while engine.has_work():
            for ev in engine.step():
                last = ev
        return last

    prompt = loaded.tokenizer.encode("It was a dark and stormy night, and the")[:32]
    run(prompt, 8)  # warm-up
    decode = []
    for _ in range(runs):
        ev = run(prompt, 128, 128)
        decode.append((ev.num_generated_tokens - 1) / ev.completion_time)
    long_ids = (loaded.tokenizer.encode(open(__file__).read()) * 20)[:1000]
    prefill = []
    for _ in range(runs):
        ev = run(long_ids, 1)
        prefill.append(1000 / ev.prompt_time)
    return statistics.median(decode), statistics.median(prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            cold = start_to_first_token(args.model, dtype, cache)
            warm = statistics.median(start_to_first_token(args.model, dtype, cache) for _ in range(args.runs))
        decode, prefill = engine_rates(args.model, dtype, args.runs)
        rows.append((dtype, cold, warm, decode, prefill))
    print(
        f"{'dtype':<10}{'first start s':>15}{'second start s':>16}{'decode tok/s':>14}{'prefill tok/s':>15}"
    )
    for dtype, cold, warm, decode, prefill in rows:
        print(f"{dtype:<10}{cold:>15.2f}{warm:>16.2f}{decode:>14.1f}{prefill:>15.1f}")
    print(
        "(start = new process to first token; decode = 128 tokens after a 32-token prompt; prefill = 1,000 tokens)"
    )


if __name__ == "__main__":
    main()
