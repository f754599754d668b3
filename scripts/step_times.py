"""A model's decode step and prefill times in-process (no HTTP): the median step of --tokens greedy tokens for
--streams requests decoded together, and the time of one prompt of each --prefill length (a request of one token).

Usage: .venv/bin/python scripts/step_times.py MODEL [--tokens 64] [--streams 1] [--prefill 128,512]
MODEL: a GGUF file or Hugging Face folder, loaded as `waferscale serve` loads it (bf16, --quantization auto). Compare
code versions alternately on a quiet machine (one run moves by 10-20% with the neighbours' load).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale.engine import LLMEngine, SamplingParams  # noqa: E402
from waferscale.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--prefill", default="128,512", help="prompt lengths to time ('' for none)")
    args = ap.parse_args()
    engine = LLMEngine(load_model(args.model, dtype="bfloat16", progress=False), enable_prefix_cache=False)

    def run(prompts: list[list[int]], tokens: int) -> list[float]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{time.time()}-{i}", prompt, SamplingParams(max_tokens=tokens, min_tokens=tokens,
                                                                             temperature=0))
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        return steps

    prompts = [list(range(100 + 40 * i, 132 + 40 * i)) for i in range(args.streams)]
    run(prompts, 4)  # warm-up
    steps = run(prompts, args.tokens)
    print(f"decode: median step {statistics.median(steps) * 1e3:.1f} ms ({args.streams} streams, {len(steps)} steps, "
          f"the first, the 32-token prompts, {steps[0] * 1e3:.0f} ms)")
    for n in [int(v) for v in args.prefill.split(",") if v]:
        print(f"prefill: one {n}-token prompt {sum(run([list(range(100, 100 + n))], 1)) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
