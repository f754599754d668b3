"""One mixture-of-experts layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, 8 active, expert width 768),
random int4 experts, bf16 activations: milliseconds a layer for a decode step of 1, 8 and 32 rows, with each active
expert's modules called from Python and with all experts in one native call (models/layers/moe.py).

    PYTHONPATH=src python scripts/bench_moe_layer.py [--threads 1] [--experts 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from waferscale import kernels
from waferscale.models.layers.linear import LoadContext
from waferscale.models.layers.moe import SOFTMAX_TOPK, NativeExperts, Routing, SparseMoE
from waferscale.models.quant import quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--active", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, e, k, i = args.hidden, args.experts, args.active, args.inter
    layer = SparseMoE(h, e, i, Routing(k, SOFTMAX_TOPK, True))
    layer.gate.load([(torch.randn(e, h) * 0.05).bfloat16()], None, "gate")
    for j, expert in enumerate(layer.experts):
        expert.gate_up_proj.load([quantize(torch.randn(2 * i, h) * 0.02, "int4")], None, f"experts.{j}.gate_up")
        expert.down_proj.load([quantize(torch.randn(h, i) * 0.02, "int4")], None, f"experts.{j}.down")
    native = kernels.load()
    ctx = LoadContext(torch.bfloat16, native, kernels.cpu_has_native_bf16())
    for m in layer.modules():
        if hasattr(m, "process_weights_after_loading"):
            m.process_weights_after_loading(ctx)
    method = layer.experts.method
    methods = {"python loop": getattr(method, "fallback", method)}
    if isinstance(method, NativeExperts):
        methods["one native call"] = method
    per_expert = sum(p.quant.nbytes() for p in (layer.experts[0].gate_up_proj, layer.experts[0].down_proj))
    print(f"{args.threads} thread(s); {e} experts, {k} active, hidden {h}, width {i}, int4")
    for rows in (1, 8, 32):
        x = torch.randn(rows, h).bfloat16()
        weights, ids = layer.routing.route(layer.gate(x))
        weights = weights.bfloat16()
        active = len(ids.unique())
        for name, m in methods.items():
            m.apply(x, ids, weights)
            n = max(3, 40 // rows)
            t = time.perf_counter()
            for _ in range(n):
                m.apply(x, ids, weights)
            dt = (time.perf_counter() - t) / n
            gbs = active * per_expert / dt / 1e9
            print(f"rows {rows:2d}, {active:3d} experts active, {name}: {dt * 1e3:6.2f} ms ({gbs:.1f} GB/s of experts)")


if __name__ == "__main__":
    main()
