"""The paged decode attention kernel alone: one sequence's step at several context lengths, median time of a call.

    .venv/bin/python scripts/bench_attention.py [--heads 32] [--kv-heads 4] [--dim 128] [--lengths 128,512,2048]
                                                [--kv bfloat16|float32|int8] [--calls 200]

The pool's blocks of 16 positions lie in a random order in a pool 8x the sequence, as a busy server's do. Defaults:
Qwen3's attention (32 query heads, 4 kv heads of 128 channels); the built-in model's is --heads 9 --kv-heads 3
--dim 64. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from waferscale import kernels
from waferscale.engine import kv_int8

BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--kv", choices=("bfloat16", "float32", "int8"), default="bfloat16")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    lib = kernels.load()
    if lib is None:
        raise SystemExit("the native kernels could not be built here")
    h, kvh, d = args.heads, args.kv_heads, args.dim
    print(f"threads {torch.get_num_threads()}, {h} query heads, {kvh} kv heads of {d}, {args.kv} KV")
    for n in map(int, args.lengths.split(",")):
        torch.manual_seed(0)
        blocks = -(-n // BS)
        k, v = torch.randn(blocks * BS * 8, kvh, d), torch.randn(blocks * BS * 8, kvh, d)
        scales = {}
        if args.kv == "int8":
            (k, ks), (v, vs) = kv_int8.quantize(k), kv_int8.quantize(v)
            scales = {"k_scale": ks, "v_scale": vs}
        elif args.kv == "bfloat16":
            k, v = k.bfloat16(), v.bfloat16()
        tables = torch.randperm(blocks * 8)[:blocks].view(1, -1).contiguous()
        lengths, q = torch.tensor([n]), torch.randn(1, h, d)
        for _ in range(20):
            lib.paged_decode_attention(q, k, v, tables, lengths, d**-0.5, BS, **scales)
        times = []
        for _ in range(args.calls):
            t = time.perf_counter()
            lib.paged_decode_attention(q, k, v, tables, lengths, d**-0.5, BS, **scales)
            times.append(time.perf_counter() - t)
        med = sorted(times)[len(times) // 2]
        flops = 2 * 2 * h * d * n  # scores and values: a multiply and an add each
        print(f"  {n:6d} positions: {med * 1e6:8.1f} us a call, {med / n * 1e9:6.0f} ns a position, "
              f"{flops / med / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
