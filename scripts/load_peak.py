"""Peak memory of loading one model, in a fresh process: ru_maxrss (the peak RSS), the RSS once loaded, and the
bytes the loaded model's tensors hold (weights, packed copies, quantized blocks; each storage counted once), so the
transient copies a loader makes show as peak - weights.

Usage: python scripts/load_peak.py MODEL [--quantization auto|none|int8|int4] [--dtype bfloat16] [--cold] [--json]

--cold: loads with an empty cache (a temporary WAFERSCALE_CACHE_DIR sharing the compiled kernels), so a GGUF's
conversion or a folder's int8/int4 quantization is part of the figure; without it, a cached conversion is made
first (in its own process) and only the load from it is measured. The baseline (the interpreter with torch and
waferscale imported, before loading) is printed too: peak - baseline is what loading added.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20


def rss_bytes() -> int:
    """VmRSS of this process."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tensor_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from a model (its modules' attributes, the methods and
    quantized weights they hold), meta tensors excepted."""
    import torch

    seen_obj: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                s = obj.untyped_storage()
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("waferscale", "torch.nn")) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def child(args) -> None:
    import torch  # noqa: F401  (in the baseline)

    from waferscale.models.loader import load_model

    base = rss_bytes()
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "model": args.model, "quantization": args.quantization, "dtype": args.dtype, "cold": args.cold,
        "served_as": loaded.quantization, "baseline_mib": base / MiB, "peak_mib": peak / MiB,
        "final_mib": rss_bytes() / MiB, "weights_mib": tensor_bytes(loaded.model) / MiB,
    }
    out["peak_over_weights_mib"] = out["peak_mib"] - out["baseline_mib"] - out["weights_mib"]
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cold", action="store_true", help="include the conversion (an empty cache)")
    p.add_argument("--json", action="store_true", help="print the JSON line only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    cmd = [sys.executable, __file__, args.model, "--quantization", args.quantization, "--dtype", args.dtype,
           "--child"] + (["--cold"] if args.cold else [])
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="load_peak-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        if args.cold:
            from waferscale.models.source import cache_root

            (Path(tmp) / "kernels").symlink_to(cache_root() / "kernels")
            env["WAFERSCALE_CACHE_DIR"] = tmp
        else:  # the conversion made and cached first, in a process of its own
            subprocess.run(cmd, env=env, check=True, capture_output=True)
        res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    line = res.stdout.strip().splitlines()[-1]
    if args.json:
        print(line)
        return
    r = json.loads(line)
    print(f"{r['model']} ({r['quantization']}, {r['dtype']}, {'cold' if r['cold'] else 'cached'}; served as "
          f"{r['served_as']}): peak RSS {r['peak_mib']:,.0f} MiB, after loading {r['final_mib']:,.0f} MiB, "
          f"weights {r['weights_mib']:,.0f} MiB, baseline {r['baseline_mib']:,.0f} MiB; "
          f"peak - baseline - weights {r['peak_over_weights_mib']:,.0f} MiB")


if __name__ == "__main__":
    main()
