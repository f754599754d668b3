"""Side-by-side benchmark of waferscale and llama.cpp's llama-server on the built-in SmolLM2-135M-Instruct.

Usage: .venv/bin/python scripts/bench_vs_llamacpp.py [--quick] [--scenarios single,prefill,c8,c32,prefix]
       [--skip-llamacpp] [--cache-dir DIR] [--json FILE]

On first use it builds llama-server from the llama.cpp vendored in the llama-cpp-python sdist and converts
waferscale's bf16 weights of the built-in model to a BF16 GGUF, all under --cache-dir (never into the project venv).
Then it runs each server alone on 127.0.0.1, one after another (the scenarios saturate a small machine), and prints
a Markdown table, each server's exact settings, and a per-run detail table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from waferscale import bench
from waferscale.local_server import proc_status, served, tail

LLAMA_CPP_PYTHON = "0.3.36"
MODEL_NAME = "smollm2-135m-instruct"
PARALLEL = 32
# With -no-kvu each slot gets -c / -np tokens (padded to 256): -c 32768 would leave 1,024, too few for a shared-prefix
# request (1,000 + 32 prompt + 32 output), so -c is the smallest size that fits: 1,280 tokens a slot. Attention spans
# only a slot's used cells (rounded up to 256), so the larger -c costs memory, not time.
LLAMA_CTX = PARALLEL * 1280
LLAMA_ARGS = f"-t 2 -tb 2 -np {PARALLEL} -no-kvu -cb -fa on -b 2048 -ub 512 -c {LLAMA_CTX}".split()
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
# ggml's AMX weight repacking killed llama-server at load (SIGILL, SIGSEGV) on a 2-core AMX Xeon VM; its AVX-512
# paths are kept (GCC's explicit -mno-* flags win over -march=native's)
if "amx_tile" in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""):
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


# ---------------------------------------------------------------- llama.cpp build and model files


def run_logged(cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None) -> None:
    """Run a setup command with its output appended to `log`; a failure exits with the log's tail."""
    print(f"  $ {' '.join(cmd)}  (log: {log})", file=sys.stderr)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"failed ({rc}): {' '.join(cmd)}\n{tail(log)}")


def llama_cpp_dir(cache: Path) -> Path:
    """The llama.cpp source tree inside the unpacked llama-cpp-python sdist, downloaded and unpacked on first use."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    src = root / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tarball.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        run_logged(cmd + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)], cache / "setup.log")
    print(f"  unpacking {tarball}", file=sys.stderr)
    with tarfile.open(tarball) as tar:
        tmp = cache / f"unpack.tmp{os.getpid()}"
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, filter="data")
        else:
            tar.extractall(tmp)
        shutil.rmtree(root, ignore_errors=True)
        (tmp / root.name).rename(root)
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def llama_server_binary(cache: Path) -> Path:
    """build/bin/llama-server, configured and built with cmake on first use (an interrupted build resumes)."""
    src = llama_cpp_dir(cache)
    binary = src / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    print("building llama-server (several minutes on 2 cores)", file=sys.stderr)
    log = cache / "build.log"
    if not (src / "build" / "CMakeCache.txt").is_file():
        run_logged(["cmake", "-B", "build", *CMAKE_ARGS], log, cwd=src)
    run_logged(
        ["cmake", "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 2}"], log, cwd=src
    )
    return binary


def hf_config(ws_config: dict, tokenizer: dict) -> tuple[dict, dict]:
    """Hugging Face config.json and tokenizer_config.json for a folder waferscale converted from the GGUF file.

    waferscale's converted folder holds its own config layout and no tokenizer_config.json; convert_hf_to_gguf.py
    reads the HF ones. Special tokens and add_bos_token follow the GGUF's metadata so both GGUFs tokenize alike.
    """
    c = ws_config
    names = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "max_position_embeddings": c["max_position_embeddings"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": c["rope_scaling"],
        "attention_bias": c["attention_bias"],
        "tie_word_embeddings": c["tie_word_embeddings"],
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[1],
        "eos_token": names[2],
        "pad_token": names[2],
        "unk_token": names[0],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": c["max_position_embeddings"],
    }
    return config, tok_config


def bf16_gguf(cache: Path, llama_dir: Path) -> Path:
    """A BF16 GGUF of exactly the weights waferscale serves (its bf16 conversion), made once by convert_hf_to_gguf.py."""
    from waferscale.models.loader import _converted_gguf
    from waferscale.models.source import builtin_model_path

    out = cache / "SmolLM2-135M-Instruct.BF16.gguf"
    if out.is_file():
        return out
    folder = _converted_gguf(builtin_model_path(), "bfloat16", progress=False)
    stage = cache / "hf-smollm2-135m-instruct-bf16"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    config, tok_config = hf_config(json.loads((folder / "config.json").read_text()), tokenizer)
    extra = json.loads((folder / "waferscale_tokenizer.json").read_text())
    if extra.get("chat_template"):
        tok_config["chat_template"] = extra["chat_template"]
    (stage / "config.json").write_text(json.dumps(config, indent=1))
    (stage / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    shutil.copy(folder / "tokenizer.json", stage / "tokenizer.json")
    (stage / "model.safetensors").symlink_to(folder / "model.safetensors")
    tmp = out.with_name(out.name + ".tmp")
    env = {**os.environ, "PYTHONPATH": converter_path(cache, llama_dir), "NO_LOCAL_GGUF": ""}
    cmd = [sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(stage), "--outtype", "bf16"]
    print("converting waferscale's bf16 weights to a BF16 GGUF", file=sys.stderr)
    run_logged(cmd + ["--outfile", str(tmp)], cache / "convert.log", env=env)
    check_same_model(tmp, builtin_model_path())
    tmp.rename(out)
    return out


def converter_path(cache: Path, llama_dir: Path) -> str:
    """PYTHONPATH for convert_hf_to_gguf.py: its gguf-py, and sentencepiece (which it imports before it looks for a
    tokenizer.model) installed into the cache when the venv lacks it."""
    paths = [str(llama_dir / "gguf-py")]
    if importlib.util.find_spec("sentencepiece") is None:
        deps = cache / "convert-deps"
        if not (deps / "sentencepiece").is_dir():
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(deps)]
            run_logged(cmd + ["sentencepiece"], cache / "setup.log")
        paths.append(str(deps))
    return os.pathsep.join(paths)


def check_same_model(bf16: Path, q41: Path) -> None:
    """Exit unless the BF16 GGUF has the Q4_1 file's tokenizer and its dequantised weights, rounded to bf16."""
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize

    a, b = gguf.GGUFReader(str(bf16)), gguf.GGUFReader(str(q41))
    for key in (
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ):
        if a.fields[key].contents() != b.fields[key].contents():
            sys.exit(f"{bf16}: {key} differs from {q41}")
    bos = a.fields.get("tokenizer.ggml.add_bos_token")
    if bos is not None and bos.contents():
        sys.exit(f"{bf16}: adds a BOS token, {q41} does not")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if ta.keys() != tb.keys():
        sys.exit(f"{bf16}: tensor names differ from {q41}: {sorted(ta.keys() ^ tb.keys())}")
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.ffn_down.weight"):
        x = torch.from_numpy(np.array(dequantize(ta[name].data, ta[name].tensor_type), dtype=np.float32))
        y = torch.from_numpy(np.array(dequantize(tb[name].data, tb[name].tensor_type), dtype=np.float32))
        if not torch.equal(x, y.to(torch.bfloat16).float()):
            sys.exit(f"{bf16}: {name} differs from {q41}")


# ---------------------------------------------------------------- the machine's decode bound


def memory_bandwidth(gib: float = 1.0, passes: int = 5, threads: int = 2) -> float:
    """Best read bandwidth in GB/s: numpy max of a `gib` GiB float32 array, split over `threads` threads.

    max rather than sum: numpy's float32 sum is pairwise and partly add-bound on one core here, max is SIMD.
    """
    import numpy as np

    data = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = math.inf
    for _ in range(passes):
        workers = [threading.Thread(target=np.max, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


def weight_bytes() -> dict[str, int]:
    """Parameters of the served model, and bytes of weights read per decoded token at bf16 and in the Q4_1 file."""
    import gguf
    from safetensors import safe_open

    from waferscale.models.loader import _converted_gguf
    from waferscale.models.source import builtin_model_path

    folder = _converted_gguf(builtin_model_path(), "bfloat16", progress=False)
    params = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            params += math.prod(f.get_slice(name).get_shape())
    q41 = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(builtin_model_path())).tensors)
    return {"params": params, "bf16": 2 * params, "q4_1": q41}


# ---------------------------------------------------------------- servers


@dataclass
class Server:
    """One server configuration to measure: how to start it and what its requests add to the body."""

    key: str
    label: str
    argv: list[str]  # without --host/--port
    fields: Callable[[int], dict]  # extra request-body fields, given the output length
    scenarios: tuple[str, ...]
    log: Path = field(default_factory=Path)


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so a later read covers only what follows."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds(pid: int | None = None) -> float:
    """Busy CPU seconds so far: the whole machine's (from /proc/stat, steal included) or one process's."""
    tick = os.sysconf("SC_CLK_TCK")
    if pid is None:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, open("/proc/stat").readline().split()[1:9]
        )
        return (user + nice + system + irq + softirq + steal) / tick
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime


def other_load(seconds: float = 3.0) -> float:
    """Cores kept busy by other processes (not this one) over a short sample."""
    m0, s0, t0 = cpu_seconds(), cpu_seconds(os.getpid()), time.perf_counter()
    time.sleep(seconds)
    return ((cpu_seconds() - m0) - (cpu_seconds(os.getpid()) - s0)) / (time.perf_counter() - t0)


def wait_until_quiet(max_wait: float, threshold: float = 0.25) -> float:
    """Wait up to `max_wait` seconds for other processes to use under `threshold` cores; the last load seen."""
    deadline = time.monotonic() + max_wait
    load = other_load()
    while load >= threshold and time.monotonic() < deadline:
        print(f"  other processes use {load:.2f} cores; waiting for a quiet machine", file=sys.stderr)
        time.sleep(20)
        load = other_load()
    if load >= threshold:
        print(f"  warning: other processes use {load:.2f} cores; figures will be skewed", file=sys.stderr)
    return load


@contextmanager
def running(server: Server, log_dir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the server on a free port, wait until /health answers 200, yield its URL, then stop it."""
    server.log = log_dir / f"{server.key}.log"
    with served(server.argv, server.log, server.label) as (url, proc):
        yield url, proc


# ---------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    """One load shape; `prefix` tokens are shared by every request of a run (and not by its warm-up)."""

    key: str
    concurrency: int
    requests: int
    prompt: int
    output: int
    prefix: int = 0


SCENARIOS = {
    "single": Scenario("single", 1, 3, 32, 128),
    "prefill": Scenario("prefill", 1, 3, 1000, 1),
    "c8": Scenario("c8", 8, 16, 128, 128),
    "c32": Scenario("c32", 32, 64, 128, 128),
    "prefix": Scenario("prefix", 32, 32, 32, 32, prefix=1000),
}
QUICK = {
    "single": Scenario("single", 1, 1, 32, 16),
    "prefill": Scenario("prefill", 1, 1, 200, 1),
    "c8": Scenario("c8", 8, 8, 32, 16),
    "c32": Scenario("c32", 32, 32, 32, 16),
    "prefix": Scenario("prefix", 8, 8, 32, 8, prefix=200),
}


async def measure(url: str, sc: Scenario, fields: Callable[[int], dict], salt: int) -> dict:
    """One warm-up request, then the scenario's runs: 'main', and for a shared prefix 'cold' then 'warm'.

    The warm-up carries no shared prefix, so the first batch finds the prefix cold; the second batch (new tails,
    same prefix) finds whatever each server kept of it. Every prompt has its own salt, so no request repeats an
    earlier prompt beyond the shared prefix (llama-server would otherwise reuse a slot's cached prompt whole).
    """

    async def go(name: str, c: int, n: int, prompt: int, output: int, prefix: str, s: int) -> dict:
        r = await bench.run(url, MODEL_NAME, c, n, prompt, output, None, prefix, fields(output), s)
        return {**r, "run": name}

    await go("warm-up", 1, 1, sc.prompt + sc.prefix, min(sc.output, 8), "", salt + 999)
    if not sc.prefix:
        return {"main": await go("main", sc.concurrency, sc.requests, sc.prompt, sc.output, "", salt)}
    # the trailing space joins the tail's first word ("ĠRequest"), so prefix + tail is exactly sc.prefix + sc.prompt
    prefix = bench.make_prompt(sc.prefix, salt + 500) + " "
    runs = {}
    for name, s in (("cold", salt), ("warm", salt + sc.requests)):
        runs[name] = await go(name, sc.concurrency, sc.requests, sc.prompt, sc.output, prefix, s)
    return runs


def waferscale_fields(output: int) -> dict:
    """Nothing to add: bench.run's body already asks for exactly `output` tokens (min_tokens = max_tokens)."""
    return {}


def llama_fields(output: int) -> dict:
    """llama-server has no min_tokens: ignore_eos plus n_predict (max_tokens' alias) makes exactly `output` tokens."""
    return {"min_tokens": None, "ignore_eos": True, "n_predict": output}


def servers(cache: Path, selected: list[str], skip_llamacpp: bool) -> list[Server]:
    """The server configurations to run, building llama-server and the BF16 GGUF first when needed."""
    from waferscale.models import builtin_model_path

    waferscale = str(Path(sys.executable).parent / "waferscale")
    ws = [Server("waferscale", "waferscale bf16", [waferscale, "serve"], waferscale_fields, tuple(selected))]
    if "prefix" in selected:
        argv = [waferscale, "serve", "--no-prefix-cache"]
        ws.append(
            Server(
                "waferscale_npc", "waferscale bf16 --no-prefix-cache", argv, waferscale_fields, ("prefix",)
            )
        )
    if skip_llamacpp:
        return ws
    binary = llama_server_binary(cache)
    bf16 = bf16_gguf(cache, llama_cpp_dir(cache))
    # cache_prompt (on by default) keeps each slot's last prompt for reuse by
    # the next request with the longest common prefix, and --cache-ram (default 8 GiB) saves evicted slot prompts.
    return ws + [
        Server(
            "llama_bf16",
            "llama-server BF16",
            [str(binary), "-m", str(bf16), *LLAMA_ARGS],
            llama_fields,
            tuple(selected),
        ),
        Server(
            "llama_q41",
            "llama-server Q4_1",
            [str(binary), "-m", str(builtin_model_path()), *LLAMA_ARGS],
            llama_fields,
            tuple(selected),
        ),
    ]


def run_server(server: Server, scenarios: dict[str, Scenario], log_dir: Path, wait_idle: float) -> dict:
    """Every selected scenario against one server, its peak RSS during c=32, and the CPU others used meanwhile."""
    out: dict = {"label": server.label, "argv": server.argv, "scenarios": {}}
    out["other_cores_before"] = wait_until_quiet(wait_idle)
    with running(server, log_dir) as (url, proc):
        out["argv"] = proc.args
        out["rss_idle"] = proc_status(proc.pid, "VmRSS")
        out["rss_load_peak"] = proc_status(proc.pid, "VmHWM")  # loading's peak, before any scenario resets it
        machine0, srv0, me0, t0 = (
            cpu_seconds(),
            cpu_seconds(proc.pid),
            cpu_seconds(os.getpid()),
            time.perf_counter(),
        )
        for i, key in enumerate(server.scenarios):
            sc = scenarios[key]
            if key == "c32":
                out["rss_reset"] = reset_peak_rss(proc.pid)
            started = time.perf_counter()
            out["scenarios"][key] = asyncio.run(measure(url, sc, server.fields, 1000 * (i + 1)))
            print(f"  {server.label}: {key} done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            if key == "c32":
                out["rss_peak_c32"] = proc_status(proc.pid, "VmHWM")
        machine, srv = cpu_seconds() - machine0, cpu_seconds(proc.pid) - srv0
        me, wall = cpu_seconds(os.getpid()) - me0, time.perf_counter() - t0
        out["server_cores"] = srv / wall
        out["other_cores"] = max(0.0, machine - srv - me) / wall
    return out


# ---------------------------------------------------------------- report


def fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def figures(result: dict, bound: float | None) -> dict[str, float | None]:
    """The table's figures for one server: higher-is-better rates and lower-is-better latencies."""
    sc = result["scenarios"]

    def get(key: str, run: str, fn) -> float | None:
        r = sc.get(key, {}).get(run)
        return None if r is None or r["errors"] == r["requests"] else fn(r)

    f: dict[str, float | None] = {
        "single_tok_s": get("single", "main", lambda r: r["decode_tok_s_p50"]),
        "single_ttft": get("single", "main", lambda r: r["ttft_p50_ms"]),
        "prefill_tok_s": get(
            "prefill", "main", lambda r: r["prompt_tokens_measured"] / r["latency_p50_ms"] * 1e3
        ),
        "c8_tok_s": get("c8", "main", lambda r: r["output_tok_s"]),
        "c32_tok_s": get("c32", "main", lambda r: r["output_tok_s"]),
        "c32_itl": get("c32", "main", lambda r: r["itl_p50_ms"]),
        "prefix_cold_ttft": get("prefix", "cold", lambda r: r["ttft_p50_ms"]),
        "prefix_warm_ttft": get("prefix", "warm", lambda r: r["ttft_p50_ms"]),
        "rss_mib": result["rss_peak_c32"] / 2**20 if result.get("rss_peak_c32") else None,
    }
    f["single_pct_bound"] = 100 * f["single_tok_s"] / bound if f["single_tok_s"] and bound else None
    return f


ROWS = [  # (figure, label, higher is better)
    ("single_tok_s", "single stream decode, tok/s (c=1, 32 → 128)", True),
    ("single_pct_bound", "single stream, % of the bandwidth bound", True),
    ("single_ttft", "single stream TTFT p50, ms", False),
    ("prefill_tok_s", "prefill, prompt tok/s (1,000 → 1)", True),
    ("c8_tok_s", "throughput c=8, output tok/s (128 → 128)", True),
    ("c32_tok_s", "throughput c=32, output tok/s (128 → 128)", True),
    ("c32_itl", "c=32 inter-token latency p50, ms", False),
    ("rss_mib", "peak RSS during c=32, MiB", False),
    ("prefix_cold_ttft", "shared 1,000-token prefix, c=32, cold: TTFT p50, ms", False),
    ("prefix_warm_ttft", "shared 1,000-token prefix, c=32, warm: TTFT p50, ms", False),
]


def speed_ratio(a: float | None, b: float | None, higher: bool) -> float | None:
    """How many times better a is than b (rates a/b, latencies b/a); >1 means a wins."""
    if not a or not b:
        return None
    return a / b if higher else b / a


def report(results: dict[str, dict], bw: float, sizes: dict[str, int], quick: bool) -> str:
    """The Markdown table, the bound, each server's settings and a per-run detail table."""
    bounds = {"bf16": bw * 1e9 / sizes["bf16"], "q4_1": bw * 1e9 / sizes["q4_1"]}
    empty: dict = {"scenarios": {}}
    ws = figures(results.get("waferscale", empty), bounds["bf16"])
    npc = figures(results.get("waferscale_npc", empty), bounds["bf16"])
    lb = figures(results.get("llama_bf16", empty), bounds["bf16"])
    lq = figures(results.get("llama_q41", empty), bounds["q4_1"])
    lines = []
    busiest = max((r["other_cores"] for r in results.values()), default=0.0)
    if busiest > 0.1:
        lines.append(
            f"**Other processes used up to {busiest:.2f} cores during a server's run: figures are skewed.**\n"
        )
    if quick:
        lines.append(
            "**--quick: tiny counts and shorter prompts/outputs than the labels say; a smoke test only.**\n"
        )
    lines += [
        "| scenario | waferscale bf16 | llama-server BF16 | waferscale ÷ llama BF16 | llama-server Q4_1 "
        "| waferscale --no-prefix-cache | prefix cache speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label, higher in ROWS:
        ratio = speed_ratio(ws[key], lb[key], higher) if key != "single_pct_bound" else None
        npc_cell = speedup = "—"
        if key.startswith("prefix"):
            npc_cell = fmt(npc[key], 0)
            speedup = fmt(speed_ratio(ws[key], npc[key], higher), 2) + ("×" if ws[key] and npc[key] else "")
        digits = 0 if key in ("rss_mib", "prefix_cold_ttft", "prefix_warm_ttft", "prefill_tok_s") else 1
        cells = [label, fmt(ws[key], digits), fmt(lb[key], digits)]
        cells += [fmt(ratio, 2) + ("×" if ratio else ""), fmt(lq[key], digits), npc_cell, speedup]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "waferscale ÷ llama BF16 (and the prefix-cache speed-up) divide rates and invert latencies and memory: "
        "above 1 means waferscale is better. Cold: the 32 requests arrive together and no request has seen the "
        "prefix; warm: 32 more requests (new tails, same prefix) right after.",
        "",
        f"Decode bound: memory read bandwidth {bw:.1f} GB/s (numpy max of 1 GiB float32 over 2 threads, best of 5) ÷ "
        f"weights read per token: bf16 2 B × {sizes['params'] / 1e6:.1f} M parameters = {sizes['bf16'] / 1e6:.0f} MB "
        f"→ {bounds['bf16']:.0f} tok/s; Q4_1 tensors {sizes['q4_1'] / 1e6:.0f} MB → {bounds['q4_1']:.0f} tok/s.",
        "",
        "Settings:",
    ]
    for r in results.values():
        if r.get("failed"):
            lines.append(
                f"- {r['label']}: `{' '.join(map(str, r['argv']))}` **failed**: {r['failed'].splitlines()[0]}"
            )
            continue
        lines.append(
            f"- {r['label']}: `{' '.join(map(str, r['argv']))}` (it used {r['server_cores']:.2f} cores; other "
            f"processes {r['other_cores']:.2f} cores on average during its run)"
        )
    lines.append(
        "- requests: temperature 0, streamed with usage; waferscale min_tokens = max_tokens, llama-server "
        "ignore_eos + n_predict; one warm-up request before each scenario; servers run one at a time."
    )
    lines += [
        "",
        "| server | scenario | run | requests | errors (resent) | prompt tok (measured) | generated / expected | cached tok "
        "| wall s | TTFT p50 ms | ITL p50 ms | out tok/s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        for key, runs in r["scenarios"].items():
            for name, x in runs.items():
                cells = [r["label"], key, name, str(x["requests"]), f"{x['errors']} ({x['resent']})"]
                cells += [
                    fmt(x["prompt_tokens_measured"], 0),
                    f"{x['completion_tokens']} / {x['requests'] * x['output_tokens']}",
                ]
                cells += [
                    str(x["cached_tokens"]),
                    fmt(x["wall_s"]),
                    fmt(x["ttft_p50_ms"]),
                    fmt(x["itl_p50_ms"], 2),
                ]
                cells.append(fmt(x["output_tok_s"]))
                lines.append("| " + " | ".join(cells) + " |")
                if x["first_error"]:
                    lines.append(f"|  | first error: {x['first_error']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test of the whole pipeline")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    ap.add_argument("--skip-llamacpp", action="store_true", help="measure waferscale only")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "waferscale-bench")
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each server, wait up to this long for other processes to leave the CPUs (default: only warn)",
    )
    args = ap.parse_args()
    selected = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(selected) - set(SCENARIOS)
    if unknown or not selected:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    scenarios = QUICK if args.quick else SCENARIOS
    cache = args.cache_dir.expanduser()
    log_dir = cache / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    plan = servers(cache, selected, args.skip_llamacpp)
    sizes = weight_bytes()
    wait_until_quiet(args.wait_idle)
    bw = memory_bandwidth()
    print(f"memory read bandwidth {bw:.1f} GB/s; load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    started = time.time()
    results = {}
    for server in plan:
        try:
            results[server.key] = run_server(server, scenarios, log_dir, args.wait_idle)
        except (
            RuntimeError
        ) as exc:  # a server that crashes (llama-server Q4_1 on some CPUs) costs its column only
            print(f"  {server.label} failed: {str(exc).splitlines()[0]}", file=sys.stderr)
            failed = {"label": server.label, "argv": server.argv, "scenarios": {}, "failed": str(exc)}
            results[server.key] = {**failed, "other_cores": 0.0, "server_cores": 0.0}
    load = os.getloadavg()
    print(report(results, bw, sizes, args.quick))
    print(f"\nCommand: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"\nTotal {time.time() - started:.0f} s; load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        f"(1/5/15 min; this benchmark alone keeps it near 2). Server logs: {log_dir}"
    )
    if args.json:
        meta = {"bandwidth_gb_s": bw, "weights": sizes, "quick": args.quick, "llama_ctx": LLAMA_CTX}
        Path(args.json).write_text(json.dumps({"meta": meta, "servers": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
