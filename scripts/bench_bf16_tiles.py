"""Packed bf16 weights at several batch sizes: the native kernel with AMX tiles on and off (the FMA panels) against
PyTorch's oneDNN on the row-major weight, for one [N, K] projection, 2 threads as the server runs.

Usage: .venv/bin/python scripts/bench_bf16_tiles.py [--shape 5120,2880] [--rows 17,32,64,256,512]
The weight is read from cache after the first call, so small batches read faster than a decode step would.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale import kernels  # noqa: E402
from waferscale.models.layers.linear import pack_bf16_chunked  # noqa: E402


def timed(fn, seconds: float = 0.4) -> float:
    """Milliseconds a call, after two warm-up calls."""
    fn()
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="5120,2880", help="N,K")
    ap.add_argument("--rows", default="17,32,64,256,512")
    args = ap.parse_args()
    torch.set_num_threads(2)
    native = kernels.load()
    if native is None:
        sys.exit("the native kernels could not be built here")
    n, k = (int(v) for v in args.shape.split(","))
    w = (torch.randn(n, k) * 0.02).bfloat16()
    packed = pack_bf16_chunked(w)
    print(f"[{n}, {k}] bf16; AMX tiles for bf16: {native.bf16_tiles()}")
    for rows in (int(v) for v in args.rows.split(",")):
        x = torch.randn(rows, k).bfloat16()
        times = {}
        for name, tiles in (("tiles", True), ("fma", False)):
            native.set_amx(tiles)
            times[name] = timed(lambda x=x: native.linear_bf16(x, packed, n, None, torch.bfloat16))
        native.set_amx(True)
        times["onednn"] = timed(lambda x=x: torch.nn.functional.linear(x, w))
        print(f"{rows:5d} rows: " + "  ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()))


if __name__ == "__main__":
    main()
