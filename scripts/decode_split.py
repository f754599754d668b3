"""Where a single stream's decode time goes: the decoder layers, the head (logits), and the rest of an engine step.

Usage: .venv/bin/python scripts/decode_split.py [MODEL] [--tokens 64] [--dtype bfloat16] [--streams N]
MODEL: a GGUF file or Hugging Face folder (default: the built-in model), served as `waferscale serve` would serve it
(--quantization auto). In-process, no HTTP: a 32-token prompt, then --tokens greedy tokens, after a warm-up request.
--streams N decodes N such requests (different prompts) together, as N concurrent streams do, and adds the median
step's time (a decode step of N rows: the prompts' steps are the slow outliers).
Set WAFERSCALE_QUANT_ACTIVATIONS or WAFERSCALE_NATIVE_KERNELS to compare paths; on a shared machine compare runs
interleaved (a, b, a, b, ...), since one run's figure moves by 15-30% with the neighbours' load.
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
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=1, help="requests decoded together")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, progress=False)
    model = type(loaded.model)
    spent = {"layers": 0.0, "logits": 0.0}

    def timed(name: str, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        return run

    model.forward, model.logits = timed("layers", model.forward), timed("logits", model.logits)
    engine = LLMEngine(loaded, enable_prefix_cache=False)
    steps_s: list[float] = []

    def request(n: int) -> float:
        for i in range(args.streams):
            prompt = list(range(100 + 40 * i, 132 + 40 * i))
            params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
            engine.add_request(f"{time.time()}-{i}", prompt, params)
        t0 = time.perf_counter()
        steps_s.clear()
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps_s.append(time.perf_counter() - t)
        return time.perf_counter() - t0

    request(8)  # warm-up
    spent.update(layers=0.0, logits=0.0)
    wall = request(args.tokens + 1)  # the prompt's step, then one step a token
    steps = len(steps_s)
    rest = wall - spent["layers"] - spent["logits"]
    median = statistics.median(steps_s) * 1e3
    streams = "" if args.streams == 1 else f"; {args.streams} streams, median step {median:.1f} ms"
    print(
        f"{wall * 1e3 / steps:.1f} ms a step: layers {spent['layers'] * 1e3 / steps:.1f}, "
        f"logits {spent['logits'] * 1e3 / steps:.1f}, rest {rest * 1e3 / steps:.1f} "
        f"({steps} steps, the first of them the 32-token prompts{streams})"
    )


if __name__ == "__main__":
    main()
