"""float32 GEMMs with float32 weights: the native kernel (cpu_kernels.c's gemm_f32, what --dtype float32 serves
with) against PyTorch's F.linear (MKL) and oneDNN's packed float32 GEMM, on the built-in model's shapes, in one run.

Usage: .venv/bin/python scripts/bench_f32.py [--rows 1,2,4,16,64,512] [--reps 5] [--threads 2]
Calls of the three are interleaved, round after round, and the best round of each reported: on a shared machine only
ratios measured together mean much. Each figure is GB/s of weights read a call (4 bytes a weight over the time per
call) and GFLOP/s; the bandwidth probe is printed beside them. The 49152-row head (113 MB) is larger than any
cache, so its one-row figures are memory speed; the layers' weights (2-7 MB) may sit in the last-level cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch  # noqa: E402

from waferscale import kernels  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}  # (N, K)


def seconds_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,16,64,512")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = kernels.load()
    if native is None:
        raise SystemExit("the native kernels could not be built here")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_vs_llamacpp import memory_bandwidth

    print(f"bandwidth probe: {memory_bandwidth(threads=args.threads):.1f} GB/s")
    print(f"{'shape':8} {'rows':>5}  {'MKL':>17}  {'oneDNN':>17}  {'native':>17}  native/MKL")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            variants = {
                "MKL": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "oneDNN": lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                "native": lambda x=x, w=w: native.linear_f32(x, w),
            }
            calls = max(1, int(2e9 / (2 * rows * n * k)))  # about 2 GFLOP a round
            best = dict.fromkeys(variants, float("inf"))
            for fn in variants.values():
                fn()  # warm-up: oneDNN builds its kernel for the shape
            for _ in range(args.reps):
                for label, fn in variants.items():
                    best[label] = min(best[label], seconds_per_call(fn, calls))
            cells = [f"{n * k * 4 / s / 1e9:5.1f} GB/s {2 * rows * n * k / s / 1e9:4.0f} GF" for s in best.values()]
            print(f"{name:8} {rows:>5}  {'  '.join(cells)}  {best['MKL'] / best['native']:.2f}x")


if __name__ == "__main__":
    main()
