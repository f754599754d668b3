"""Q6_K (int6) and Q5_0 (int5) kept in their bits against the same values held a byte a weight (the layout they had
before): qgemm's time on one weight, at several batch sizes, in one run, calls interleaved; and whether the two give
the same bits (they must).

Usage: .venv/bin/python scripts/bench_packed_bits.py [--kind Q6_K|Q5_0] [--shape 49152x2048] [--rows 1,2,32]
       [--reps 7]
The default shape is Qwen3-30B-A3B's head (Q6_K in a Q4_K_M file). Weights are random GGUF blocks, repacked as the
loader repacks them; a weight larger than the caches is read from memory at every call, as decoding reads it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale import kernels  # noqa: E402
from waferscale.models.quant import QuantWeight, from_gguf  # noqa: E402

BLOCK = {"Q6_K": (256, 210), "Q5_0": (32, 22)}  # weights a block, bytes a block


def random_blocks(kind: str, n: int, k: int) -> np.ndarray:
    """Random blocks whose float16 scales are small finite values."""
    per, size = BLOCK[kind]
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, n * k // per).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":
        b[:, 208:210] = scale
    else:
        b[:, 0:2] = scale
    return b.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="Q6_K", choices=sorted(BLOCK))
    ap.add_argument("--shape", default="49152x2048")
    ap.add_argument("--rows", default="1,2,32")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    native = kernels.load()
    if native is None:
        raise SystemExit("the native kernels could not be built here")
    n, k = (int(v) for v in args.shape.split("x"))
    packed = from_gguf(random_blocks(args.kind, n, k), args.kind, n, k)
    as_bytes = QuantWeight(packed.values().to(torch.int8 if packed.signed else torch.uint8).contiguous(),
                           packed.scales, packed.mins, 8, packed.group, packed.signed, packed.sup, packed.supm)
    print(f"{args.kind} [{n}, {k}]: int{packed.bits} {packed.nbytes() / 1e6:.1f} MB, bytes {as_bytes.nbytes() / 1e6:.1f} MB")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k).to(torch.bfloat16)
        spent: dict[str, list[float]] = {"packed": [], "bytes": []}
        outs = {}
        for _ in range(args.reps):
            for name, w in (("packed", packed), ("bytes", as_bytes)):
                out = torch.empty(rows, n, dtype=torch.bfloat16)
                t = time.perf_counter()
                native.qgemm(x, w, out, act=2)
                spent[name].append(time.perf_counter() - t)
                outs[name] = out
        a, b = (statistics.median(spent[key]) * 1e3 for key in ("packed", "bytes"))
        same = "same bits" if torch.equal(outs["packed"], outs["bytes"]) else "DIFFERENT"
        print(f"  {rows:3d} rows: int{packed.bits} {a:.2f} ms, bytes {b:.2f} ms ({a / b:.2f}x); {same}")


if __name__ == "__main__":
    main()
