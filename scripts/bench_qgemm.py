"""Microbenchmark of the quantized GEMM (kernels/quant_kernels.c's qgemm) against the bf16 packed GEMM
(cpu_kernels.c's gemm_bf16_packed) on the same shapes, in the same run, with a memory-bandwidth probe beside them.

Usage: .venv/bin/python scripts/bench_qgemm.py [--model 135m,1b] [--rows 1,32] [--kinds q4,q8] [--reps 7]
                                               [--threads N] [--baseline REF] [--baseline-act auto] [--stream MB]
                                               [--int8] [--flat]
Each shape is a decoder projection (y = x W^T, bf16 rows in, bf16 out, as decoding calls it). Calls of every
variant are interleaved, round after round, and the medians reported: on a shared machine only ratios measured
together mean much. GB/s is the weight bytes read per call (bf16: 2 a weight; quantized: blocks, scales and mins)
over the time per call. --int8 adds qgemm with activations rounded to int8 (WAFERSCALE_QUANT_ACTIVATIONS=int8's
path) and its time over the float32 path's (i8/q). --baseline REF also times qgemm as quant_kernels.c was at git revision REF (built
beside the current one), for before/after figures. --stream MB rotates each variant over copies of its weight
that add up to at least MB megabytes, so that every call reads its weights from memory as a model's decoding
does: without it, a weight that fits in the last-level cache (every 135M one, some 1B ones) may be read from the
cache after the first call. (On the 2-core AVX2 machine, 1B gate_up and down at one row measured the same within
the run-to-run noise either way: int4 10-12 GB/s, int8 16-18, with 20-24 from the probe.) --flat adds, for the
K-quants' two-level layouts (q4k, q5k, q6k), the same weights with their scales multiplied out into one float32
per group (the layout they had before), and its time over the two-level one's (flat/q). A baseline revision gets
its weights in that one-level form too (older kernels know no other). For the K-quants and 8-bit blocks, "auto" is
qgemm as the server calls it by default (act=2: int8 activations, per 256 for the K-quants below 16 rows, per 32
for 8-bit blocks below 12), beside the float32 path ("quant"). --baseline-act auto times the baseline revision
that way too, and new/base is then auto's time over the baseline's.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from waferscale import kernels  # noqa: E402
from waferscale.models.quant import QuantWeight  # noqa: E402
from waferscale.models.quant.layouts import pack_int6  # noqa: E402

# [N, K] of each projection: SmolLM2-135M (the built-in model; hidden 576, intermediate 1536, 9 heads, 3 kv heads of
# 64) and a Llama 3.2 1B (hidden 2048, intermediate 8192, 32 heads, 8 kv heads of 64)
SHAPES = {
    "135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "135m_head": {"head": (49152, 576)},  # the built-in model's 49k words (its GGUF holds them in Q8_0)
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "gemma270m": {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048)},
    "gemma270m_head": {"head": (262144, 640)},
    # Qwen3-30B-A3B (hidden 2048, 32 heads and 4 kv heads of 128, one expert's width 768) with the built-in tokenizer's
    # 49k words, as scripts/bench_moe.py serves make_random_model.py's shape
    "qwen3moe": {"qkv": (5120, 2048), "o": (2048, 4096), "expert_gate_up": (1536, 2048), "expert_down": (2048, 768)},
    "qwen3moe_head": {"head": (49152, 2048)},
}
# bits, group, signed, mins, two-level scales: Q4_0/Q4_1/--quantization int4 (q4h: float16 scales, as a GGUF holds them); Q8_0/int8; Q4_K; Q6_K; Q5_K
KINDS = {
    "q4": (4, 32, False, True, False),
    "q4h": (4, 32, False, True, False),  # Q4_1 as a GGUF holds it: scales and mins in float16
    "q8": (8, 32, True, False, False),
    "q4k": (4, 32, False, True, True),
    "q6k": (8, 16, True, False, True),
    "q6k6": (6, 16, True, False, True),  # Q6_K in its 6 bits, as a GGUF's are held
    "q5k": (8, 32, False, True, True),
}


def random_weight(kind: str, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    bits, group, signed, mins, two = KINDS[kind]
    if bits == 6:  # the same values as q6k's, packed as from_gguf packs Q6_K
        w8 = random_weight("q6k", n, k, gen)
        q = (w8.qweight.numpy().astype(np.int16) + 32).astype(np.uint8).reshape(n, k // 32, 32)
        return QuantWeight(torch.from_numpy(pack_int6(q)), w8.scales, None, 6, 16, True, w8.sup)
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    elif signed:
        q = torch.randint(-32 if two else -127, 32 if two else 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen)
    if two:  # K-quants: bytes per group times a float32 per 256 weights
        scales = torch.randint(1, 64, (n, k // group), dtype=torch.uint8, generator=gen)
        scales = scales.view(torch.int8) if signed else scales
        m = torch.randint(0, 64, (n, k // group), dtype=torch.uint8, generator=gen) if mins else None
        sup = torch.rand(n, k // 256, generator=gen) * 0.001 + 0.0001
        supm = -torch.rand(n, k // 256, generator=gen) * 0.001 if mins else None
        return QuantWeight(q, scales, m, bits, group, signed, sup, supm)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    m = -torch.rand(n, k // group, generator=gen) * 0.05 if mins else None
    if kind.endswith("h"):
        scales, m = scales.half(), None if m is None else m.half()
    return QuantWeight(q, scales, m, bits, group, signed)


def flat(w: QuantWeight) -> QuantWeight:
    """The same weight with one-level float32 scales and mins (two-level ones multiplied out)."""
    return QuantWeight(w.qweight, w.scale_values(), w.min_values(), w.bits, w.group, w.signed)


class _OldSignature:
    """qgemm of a revision before two-level scales: the weights passed one-level."""

    def __init__(self, lib):
        self.lib = lib

    def qgemm(self, x, w, out, bias=None, residual=None, act=0):
        w = flat(w)
        self.lib.qgemm(
            x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], w.qweight.data_ptr(), w.bits,
            int(w.signed), w.group, w.scales.data_ptr(), None if w.mins is None else w.mins.data_ptr(),
            None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
            out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0), w.out_features, int(act == 1),
        )


def baseline_kernels(ref: str) -> kernels.NativeKernels:
    """qgemm as quant_kernels.c was at git revision ref, compiled as the current build compiles it (in two units
    where the revision has WQ_PART)."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(
        ["git", "show", f"{ref}:src/waferscale/kernels/quant_kernels.c"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    tmp = Path(tempfile.mkdtemp(prefix="bench_qgemm-"))
    (tmp / "q.c").write_bytes(src)
    flags = kernels.COMPILE_FLAGS + kernels.VARIANT_FLAGS[kernels._variant()]  # WAFERSCALE_NATIVE_KERNELS's build
    parts = [["-DWQ_PART=1"], ["-DWQ_PART=2"]] if b"WQ_PART" in src else [[]]
    objs = [str(tmp / f"q{i}.o") for i in range(len(parts))]
    for part, obj in zip(parts, objs):
        subprocess.run(["cc", *flags, *part, "-c", str(tmp / "q.c"), "-o", obj], check=True)
    subprocess.run(["cc", *kernels.LINK_FLAGS, *objs, "-o", str(tmp / "q.so"), "-lm"], check=True)
    lib = ctypes.CDLL(str(tmp / "q.so"))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    if b"int sfmt" in src:  # scales in three formats: today's signature
        lib.qgemm.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ctypes.c_int, ctypes.c_int, i64, ptr, ptr, ptr, ptr]
        lib.qgemm.argtypes += [ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, i64, i64, ctypes.c_int]
        lib.qgemm.restype = None
        return kernels.NativeKernels(lib)
    lib.qgemm.argtypes = [
        ptr,
        ctypes.c_int,
        i64,
        i64,
        ptr,
        ctypes.c_int,
        ctypes.c_int,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
    ]
    lib.qgemm.argtypes += [ptr, ctypes.c_int, i64, i64, ctypes.c_int]
    lib.qgemm.restype = None
    return _OldSignature(lib)


def copies(nbytes: int, stream_mb: int) -> int:
    """How many copies of a weight of nbytes add up to stream_mb megabytes (1 without --stream)."""
    return max(1, -(-stream_mb * 10**6 // nbytes))


def clone(w: QuantWeight) -> QuantWeight:
    def c(t):
        return None if t is None else t.clone()

    return QuantWeight(c(w.qweight), c(w.scales), c(w.mins), w.bits, w.group, w.signed, c(w.sup), c(w.supm))


def rotating(items: list, fn):
    """A call of fn on the next of items, round and round."""
    it = itertools.cycle(items)
    return lambda: fn(next(it))


def per_call(fn, budget: float = 0.03) -> float:
    """Seconds a call, over as many calls as fit in about `budget` seconds (at least 2)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    n = max(2, int(budget / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def bandwidth_probe() -> float:
    """GB/s of torch's sum over a 1 GB float32 tensor (all threads): what streaming memory gives here."""
    big = torch.ones(1 << 28)
    big.sum()
    t0 = time.perf_counter()
    big.sum()
    return big.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="135m,1b")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--kinds", default="q4,q8")
    ap.add_argument("--shapes", default="", help="only these projections (qkv,o,gate_up,down)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: torch's)")
    ap.add_argument(
        "--stream", type=int, default=0, help="rotate over copies of each weight adding up to this many MB"
    )
    ap.add_argument("--int8", action="store_true", help="also time qgemm with activations rounded to int8")
    ap.add_argument("--flat", action="store_true", help="also time two-level weights with one-level scales")
    ap.add_argument("--stat", choices=["median", "min"], default="median", help="of the rounds, per variant")
    ap.add_argument(
        "--baseline", default="", help="also time qgemm from quant_kernels.c at this git revision"
    )
    ap.add_argument(
        "--baseline-act",
        choices=["float32", "auto"],
        default="float32",
        help="the baseline's activations (auto: a revision with act modes, as the server calls it)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP runtime and its setting
    native = kernels.load()
    if native is None:
        sys.exit("native kernels unavailable")
    base = baseline_kernels(args.baseline) if args.baseline else None
    base_act = 2 if args.baseline_act == "auto" else 0
    gen = torch.Generator().manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; columns: ms a call ({args.stat} of {args.reps} interleaved rounds), GB/s "
        "of weights read; ratios are same-run"
    )
    head = f"{'model':5} {'proj':8} {'N':>6} {'K':>5} {'kind':4} {'M':>3} | {'bf16 ms':>8} {'GB/s':>5} | "
    head += f"{'quant ms':>8} {'GB/s':>5} | {'q/bf16':>6}"
    head += f" | {'int8 ms':>8} {'i8/q':>6}" if args.int8 else ""
    head += f" | {'auto ms':>8} {'GB/s':>5} {'auto/q':>6}"
    head += f" | {'flat ms':>8} {'flat/q':>6}" if args.flat else ""
    head += f" | {'base ms':>8} {'GB/s':>5} {'new/base':>8}" if base else ""
    print(head + " | probe GB/s")
    for model in args.model.split(","):
        for proj, (n, k) in SHAPES[model].items():
            if args.shapes and proj not in args.shapes.split(","):
                continue
            dense = torch.randn(n, k, generator=gen) * 0.02
            packs = [kernels.pack_bf16(dense.bfloat16()) for _ in range(copies(n * k * 2, args.stream))]
            del dense
            for kind in args.kinds.split(","):
                w = random_weight(kind, n, k, gen)
                ws = [w] + [clone(w) for _ in range(copies(w.nbytes(), args.stream) - 1)]
                flats = [flat(c) for c in ws] if args.flat and w.sup is not None else None
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k, generator=gen).bfloat16()
                    out = torch.empty(m, n, dtype=torch.bfloat16)
                    fns = {
                        "bf16": rotating(packs, lambda p, x=x, n=n: native.linear_bf16(x, p, n, None, torch.bfloat16)),
                        "quant": rotating(ws, lambda q, x=x, out=out: native.qgemm(x, q, out)),
                    }
                    if args.int8:
                        fns["int8"] = rotating(ws, lambda q, x=x, out=out: native.qgemm(x, q, out, act=1))
                    if w.sup is not None or kind in ("q8", "q4", "q4h"):  # the default (q4: AMX bf16 tiles where there are)
                        fns["auto"] = rotating(ws, lambda q, x=x, out=out: native.qgemm(x, q, out, act=2))
                    if flats:
                        fns["flat"] = rotating(flats, lambda q, x=x, out=out: native.qgemm(x, q, out))
                    if base:
                        old = flats if flats and isinstance(base, _OldSignature) else ws
                        fns["base"] = rotating(old, lambda q, x=x, out=out: base.qgemm(x, q, out, act=base_act))
                    times: dict[str, list[float]] = {name: [] for name in fns}
                    probes = []
                    for rep in range(args.reps):
                        names = list(fns)
                        names = names[rep % len(names) :] + names[: rep % len(names)]
                        for name in names:
                            times[name].append(per_call(fns[name]))
                        if rep % 3 == 0:
                            probes.append(bandwidth_probe())
                    med = {name: statistics.median(t) for name, t in times.items()}
                    if args.stat == "min":
                        med = {name: min(t) for name, t in times.items()}
                    qbytes, bbytes = w.nbytes(), n * k * 2
                    line = f"{model:5} {proj:8} {n:6} {k:5} {kind:4} {m:3} | {med['bf16'] * 1e3:8.3f} "
                    line += f"{bbytes / med['bf16'] / 1e9:5.1f} | {med['quant'] * 1e3:8.3f} "
                    line += f"{qbytes / med['quant'] / 1e9:5.1f} | {med['quant'] / med['bf16']:6.2f}"
                    if args.int8:
                        line += f" | {med['int8'] * 1e3:8.3f} {med['int8'] / med['quant']:6.2f}"
                    a = med.get("auto")
                    line += f" | {a * 1e3:8.3f} {qbytes / a / 1e9:5.1f} {a / med['quant']:6.2f}" if a else f" | {'':21}"
                    if args.flat:
                        f = med.get("flat")
                        line += f" | {f * 1e3:8.3f} {f / med['quant']:6.2f}" if f else f" | {'':8} {'':6}"
                    if base:
                        line += f" | {med['base'] * 1e3:8.3f} {qbytes / med['base'] / 1e9:5.1f} "
                        new = med["auto"] if base_act == 2 and "auto" in med else med["quant"]
                        line += f"{new / med['base']:8.2f}"
                    print(line + f" | {statistics.median(probes):5.1f}", flush=True)


if __name__ == "__main__":
    main()
