"""Mixture-of-experts serving side by side with llama.cpp's llama-server, in one run: single stream, c=8 and c=32
output tok/s, peak RSS at load and while serving, and each single-stream figure beside the bound computed from the
bytes a token actually reads (attention, router, the k active experts of each layer, the head).

Usage: .venv/bin/python scripts/bench_moe.py --model DIR [--kinds Q4_K_M,Q8_0|MXFP4] [--scenarios single,c8,c32]
       [--servers a,b] [--quick] [--skip-llamacpp] [--cache-dir DIR] [--kv-cache-memory MIB] [--json FILE]
       [--ws-arg=ARG ...]

--model: a Hugging Face folder of a random MoE with a published model's layer shapes, e.g. Qwen3-30B-A3B's with
`make_random_model.py --preset qwen3-30b-a3b --layers 12 --tokenizer .../tokenizer.json OUT` (the project's shared
bench folder has it). The folder is converted to BF16 with llama.cpp's convert_hf_to_gguf.py and quantized with its
llama-quantize (built from the llama-cpp-python sdist into --cache-dir, as scripts/bench_quant.py does); both
servers then serve the same GGUF with 2 threads and the same KV budget, one server at a time. For gpt-oss
(`--preset gpt-oss-20b`, experts in MXFP4 blocks as released) the kind MXFP4 is the converter's own output: the
experts kept in MXFP4, everything else bf16, as llama.cpp's published gpt-oss GGUFs hold them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_quant as quant  # noqa: E402  (GGUF conversion, llama.cpp binaries, bytes per weight in our layouts)
import bench_vs_llamacpp as base  # noqa: E402  (the runner, the scenarios and the bandwidth probe)

SCENARIOS = {k: base.SCENARIOS[k] for k in ("single", "c8", "c32")}
QUICK = {k: base.QUICK[k] for k in ("single", "c8", "c32")}


def active_bytes(path: Path, ours: bool) -> tuple[int, int]:
    """(bytes a token reads, bytes of all weights) of a GGUF: an expert tensor (`*_exps`) counts k/E of its bytes,
    in our layouts (ours) or as stored (llama-server)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    experts = int(reader.fields[f"{arch}.expert_count"].parts[-1][0])
    active = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    read = total = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        if ours and kind in quant.OURS_BPW:
            size = int(t.n_elements * quant.OURS_BPW[kind])
        elif ours and kind in ("F16", "BF16"):
            size = int(t.n_elements) * 2
        else:
            size = int(t.n_bytes)
        total += size
        read += size * active // experts if "_exps" in t.name else size
    return read, total


def kv_bytes_per_token(folder: Path) -> int:
    """f16/bf16 K and V of every layer for one token (both servers hold 2 bytes an element)."""
    c = json.loads((folder / "config.json").read_text())
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * 2 * c["num_key_value_heads"] * d * c["num_hidden_layers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a random MoE Hugging Face folder")
    ap.add_argument("--kinds", default="Q4_K_M,Q8_0",
                    help="GGUF quantizations to compare (Q4_K_M, Q8_0; MXFP4 for an MXFP4 checkpoint)")
    ap.add_argument("--scenarios", default="single,c8,c32")
    ap.add_argument("--servers", help="comma-separated keys to run, in this order (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "waferscale-bench")
    ap.add_argument("--kv-cache-memory", type=int, default=512, metavar="MIB")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--ws-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every waferscale serve (repeatable), e.g. --ws-arg=--speculative "
                         "--ws-arg=none: a random model's repetitive output flatters n-gram speculation, which "
                         "llama-server does not run by default")
    args = ap.parse_args()
    cache = args.cache_dir.expanduser()
    log_dir = cache / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    folder = args.model.resolve()
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    kv = args.kv_cache_memory << 20
    kinds = args.kinds.split(",")
    ggufs = quant.ggufs_of(folder, cache, tuple("BF16" if k == "MXFP4" else k for k in kinds))
    ggufs["MXFP4"] = ggufs["BF16"]  # an MXFP4 checkpoint's conversion: its experts stay MXFP4
    ws = str(Path(sys.executable).parent / "waferscale")
    runs = []  # (kind, server, bytes a token reads, weight bytes)
    for kind in kinds:
        path = ggufs[kind]
        argv = [ws, "serve", "--model", str(path), "--served-model-name", base.MODEL_NAME,
                "--kv-cache-memory", str(kv), "--threads", "2", *args.ws_arg]
        runs.append((kind, base.Server(f"ws_{kind}", f"waferscale {kind}", argv, base.waferscale_fields, ()),
                     *active_bytes(path, True)))
        if not args.skip_llamacpp:
            ctx = kv // kv_bytes_per_token(folder)
            argv = [str(quant.llama_binary(cache, "llama-server")), "-m", str(path), "-t", "2", "-tb", "2",
                    "-np", "32", "-cb", "-fa", "on", "-c", str(ctx), "-no-kvu", "--alias", base.MODEL_NAME]
            runs.append((kind, base.Server(f"llama_{kind}", f"llama-server {kind}", argv, base.llama_fields, ()),
                         *active_bytes(path, False)))
    if args.servers:
        order = args.servers.split(",")
        runs = sorted((r for r in runs if r[1].key in order), key=lambda r: order.index(r[1].key))
    scenarios = {k: v for k, v in (QUICK if args.quick else SCENARIOS).items() if k in args.scenarios.split(",")}
    for _, server, _, _ in runs:
        server.scenarios = tuple(scenarios)
    bw = base.memory_bandwidth()
    print(f"memory read bandwidth {bw:.1f} GB/s; load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    rows = []
    for kind, server, nbytes, weights in runs:
        try:
            r = base.run_server(server, scenarios, log_dir, 0)
        except RuntimeError as exc:
            print(f"  {server.label} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
            rows.append((kind, server, nbytes, weights, None))
            continue
        rows.append((kind, server, nbytes, weights, r))
        f = base.figures(r, None)
        print(f"  {server.label}: single {base.fmt(f['single_tok_s'])}, c=8 {base.fmt(f['c8_tok_s'])}, "
              f"c=32 {base.fmt(f['c32_tok_s'])} tok/s", file=sys.stderr, flush=True)
    print(f"Random {folder.name} ({layers} layers), KV budget {args.kv_cache_memory} MiB for both servers.\n")
    print("| quant | server | single tok/s | bound tok/s (MB a token) | % of bound | c=8 tok/s | c=32 tok/s "
          "| weights MB | peak RSS at load MiB | peak RSS serving MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    dump = []
    for kind, server, nbytes, weights, r in rows:
        if r is None:
            print(f"| {kind} | {server.label} | failed | | | | | | | |")
            continue
        f = base.figures(r, None)
        bound = bw * 1e9 / nbytes
        pct = 100 * f["single_tok_s"] / bound if f["single_tok_s"] else None
        load_peak, serve_peak = r.get("rss_load_peak"), r.get("rss_peak_c32") or r.get("rss_idle")
        cells = [kind, server.label, base.fmt(f["single_tok_s"]), f"{base.fmt(bound)} ({nbytes / 1e6:,.0f})",
                 base.fmt(pct, 0), base.fmt(f["c8_tok_s"]), base.fmt(f["c32_tok_s"]), f"{weights / 1e6:,.0f}",
                 base.fmt(load_peak / 2**20 if load_peak else None, 0),
                 base.fmt(serve_peak / 2**20 if serve_peak else None, 0)]
        print("| " + " | ".join(cells) + " |")
        dump.append({"kind": kind, "key": server.key, "argv": r["argv"], "figures": f, "bound": bound,
                     "bytes_per_token": nbytes, "weights": weights, "rss_load_peak": load_peak,
                     "rss_serving_peak": serve_peak, "other_cores": r["other_cores"]})
    print(f"\nbandwidth: numpy max of 1 GiB over 2 threads, best of 5: {bw:.1f} GB/s; bound = bandwidth / bytes a "
          "token reads (experts at k/E of their bytes). Peak RSS at load: VmHWM once the server answers /health; "
          "serving: VmHWM during c=32 (peak reset before it).")
    print(f"Command: {' '.join([Path(sys.executable).name, *sys.argv])}; load average at the end "
          f"{os.getloadavg()[0]:.2f}. Logs: {log_dir}")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gb_s": bw, "runs": dump}, indent=1, default=str))


if __name__ == "__main__":
    main()
