"""In-process throughput of N concurrent streams: R requests of P random prompt tokens -> T greedy tokens each, at
most N decoding at once (as N concurrent clients that each send their next request at once), no prefix cache.

Usage: .venv/bin/python scripts/bench_mix.py MODEL [--streams 32] [--requests 64] [--prompt 128] [--tokens 128]
           [--speculative none]
MODEL: a GGUF file or Hugging Face folder, loaded as `waferscale serve` loads it (bf16, --quantization auto).
--speculative ngram drafts only while at most 4 sequences decode (SpeculativeConfig.max_seqs: beyond, a step is
bound by compute), so it matters for --streams 4 or fewer. Prints output tokens/s over the whole mix, the median
step (a decode step of N rows), and the seconds spent in steps over 400 ms (the prompts' prefill chunks). Compare
code versions alternately on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale.engine import LLMEngine, SamplingParams  # noqa: E402
from waferscale.engine.speculation import SpeculativeConfig  # noqa: E402
from waferscale.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--speculative", default="none", choices=["none", "ngram"])
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="bfloat16", progress=False)
    engine = LLMEngine(
        loaded,
        enable_prefix_cache=False,
        max_num_seqs=args.streams,
        speculative=SpeculativeConfig(method=args.speculative),
    )
    rng = random.Random(0)
    vocab = min(loaded.config.vocab_size, 40000)

    def run(requests: int) -> tuple[float, list[float]]:
        for i in range(requests):
            prompt = [rng.randrange(100, vocab) for _ in range(args.prompt)]
            params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0)
            engine.add_request(f"mix-{time.time()}-{i}", prompt, params)
        t0, steps = time.perf_counter(), []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        return time.perf_counter() - t0, steps

    run(2)  # warm-up
    wall, steps = run(args.requests)
    steps.sort()
    print(
        f"{args.requests * args.tokens / wall:.1f} tok/s ({args.requests} requests of {args.prompt} -> {args.tokens} "
        f"tokens, {args.streams} at a time), {wall:.1f} s, {len(steps)} steps, median {steps[len(steps) // 2] * 1e3:.1f}"
        f" ms, steps over 400 ms {sum(s for s in steps if s > 0.4):.1f} s"
    )


if __name__ == "__main__":
    main()
