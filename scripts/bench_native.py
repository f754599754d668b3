"""In-process A/B of the native CPU kernels: the same engine figures with them on and off (WAFERSCALE_NATIVE_KERNELS).

Usage: .venv/bin/python scripts/bench_native.py [--rounds 2]
Each round runs one fresh process per setting, alternating, so slow spells of a shared machine hit both; prints
prefill tok/s (1,000-token prompt), single-stream ms/token, the decode step at 32 sequences, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "README.md"  # prompts are slices of its tokens

CHILD = r"""
import json, resource, sys, time
from waferscale import kernels
from waferscale.engine import LLMEngine, SamplingParams
from waferscale.models import load_model

loaded = load_model(None, dtype="bfloat16", progress=False)
ids = loaded.tokenizer.encode(open(sys.argv[1]).read() * 3)
engine = LLMEngine(loaded, enable_prefix_cache=False)

def prefill():
    engine.add_request("p", (ids * 3)[:1000], SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t

def single():
    engine.add_request("s", ids[:32], SamplingParams(max_tokens=64, min_tokens=64, temperature=0))
    for _ in range(4):
        engine.step()
    t, n = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        n += 1
    return (time.perf_counter() - t) / n

prefill()
pf = min(prefill() for _ in range(3))
one = min(single() for _ in range(3))
for i in range(32):
    engine.add_request(f"r{i}", ids[i * 7 : i * 7 + 128], SamplingParams(max_tokens=128, min_tokens=128, temperature=0))
for _ in range(30):
    engine.step()
step = 1e9
for _ in range(5):
    t = time.perf_counter()
    for _ in range(6):
        engine.step()
    step = min(step, (time.perf_counter() - t) / 6)
print(json.dumps({
    "native": kernels.load() is not None,
    "prefill_tok_s": 1000 / pf,
    "single_ms_per_token": one * 1000,
    "c32_step_ms": step * 1000,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def run(native: bool) -> dict:
    env = {**os.environ, "WAFERSCALE_NATIVE_KERNELS": "1" if native else "0"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(TEXT)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):
        for native in (False, True):
            rows.append(run(native))
            r = rows[-1]
            print(
                f"native={'on ' if r['native'] else 'off'}  prefill {r['prefill_tok_s']:6.0f} tok/s  "
                f"single {r['single_ms_per_token']:5.1f} ms/token  c=32 step {r['c32_step_ms']:6.1f} ms "
                f"({32000 / r['c32_step_ms']:4.0f} tok/s)  peak RSS {r['peak_rss_mib']:5.0f} MiB",
                flush=True,
            )
    best = {
        on: {
            "prefill": max(r["prefill_tok_s"] for r in rows if r["native"] == on),
            "single": min(r["single_ms_per_token"] for r in rows if r["native"] == on),
            "step": min(r["c32_step_ms"] for r in rows if r["native"] == on),
        }
        for on in (False, True)
    }
    if all(any(r["native"] == on for r in rows) for on in (False, True)):
        off, on = best[False], best[True]
        print(
            f"best of {args.rounds}: prefill {on['prefill'] / off['prefill']:.2f}x, "
            f"single stream {off['single'] / on['single']:.2f}x, c=32 decode step {off['step'] / on['step']:.2f}x "
            "(native over PyTorch; above 1 is faster)"
        )
    else:
        print("the native kernels could not be built here: only the PyTorch path was measured")


if __name__ == "__main__":
    main()
