"""Speculative decoding over HTTP, side by side with llama.cpp's llama-server and its own n-gram speculation.

Usage: .venv/bin/python scripts/bench_speculation_server.py [--model FILE|NAME] [--tokens 96] [--rounds 2]
           [--llama-spec ngram-simple ...] [--cache-dir DIR]
Both servers serve the same GGUF (default: the built-in model; `gemma-3-270m` for the Gemma 3 extra's) with 2
threads. Each task of scripts/data/spec_tasks.json (grounded and open-ended) is one streamed chat completion,
greedy, `max_tokens` --tokens, one at a time; a configuration runs every task, then the next configuration (rounds
alternate them: the machine's speed drifts over minutes). Figures: output tokens/s over decoding (first streamed
token to the last, as llama-server's predicted_per_second; speculation cannot shorten a prompt's prefill), medians
over tasks and rounds, and whether each speculative configuration's texts equal its own server's without
speculation. llama-server's n-gram modes are tried with their defaults (--llama-spec, repeatable; the best is the
one to beat).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))
import bench_vs_llamacpp as base  # noqa: E402
from bench_quant import llama_binary  # noqa: E402

from waferscale.models import builtin_model_path  # noqa: E402

MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server and wait until it answers /health (or /v1/models)."""
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not start in time; see {log}")


def complete(port: int, text: str, tokens: int) -> tuple[str, int, float]:
    """One streamed greedy chat completion: its text, output tokens and seconds from first to last token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts, first, last, n = [], None, None, 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    parts.append(piece)
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return "".join(parts), n, (last - first) if first and last else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or built-in model name (default: the built-in one)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-spec", action="append", default=None, metavar="TYPE")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "waferscale-bench")
    args = ap.parse_args()
    cache = args.cache_dir.expanduser()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    gguf = Path(args.model) if args.model and Path(args.model).is_file() else builtin_model_path(args.model)
    ws = str(Path(sys.executable).parent / "waferscale")
    llama = str(llama_binary(cache, "llama-server"))
    tasks = json.loads((Path(__file__).with_name("data") / "spec_tasks.json").read_text())
    configs: dict[str, list[str]] = {}
    for spec in ("none", "ngram"):
        configs[f"waferscale {spec}"] = [ws, "serve", "--model", str(gguf), "--served-model-name", MODEL]
        configs[f"waferscale {spec}"] += ["--speculative", spec, "--port", "{port}"]
    for spec in ["none"] + (args.llama_spec or ["ngram-simple", "ngram-map-k", "ngram-mod"]):
        argv = [llama, "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1", "-fa", "on"]
        argv += ["--alias", MODEL, "--port", "{port}"] + ([] if spec == "none" else ["--spec-type", spec])
        configs[f"llama-server {spec}"] = argv
    rates: dict[str, dict[str, list[float]]] = {c: {"grounded": [], "open": []} for c in configs}
    texts: dict[str, dict[tuple[str, int], str]] = {c: {} for c in configs}
    print(f"memory read bandwidth {base.memory_bandwidth():.1f} GB/s; {gguf.name}", file=sys.stderr)
    for _ in range(args.rounds):
        for name, argv in configs.items():
            port = free_port()
            log = cache / "logs" / f"spec-{name.replace(' ', '-')}.log"
            proc = start([a.replace("{port}", str(port)) for a in argv], port, log)
            try:
                complete(port, "Hello", 8)  # warm-up
                for kind in ("grounded", "open"):
                    for i, text in enumerate(tasks[kind]):
                        out, n, secs = complete(port, text, args.tokens)
                        texts[name][(kind, i)] = out
                        if secs > 0 and n > 1:
                            rates[name][kind].append((n - 1) / secs)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(f"  {name}: grounded {statistics.median(rates[name]['grounded']):.1f} tok/s", file=sys.stderr)
    print("| configuration | grounded tok/s | x own none | open-ended tok/s | x own none | texts = own none |")
    print("|---|---:|---:|---:|---:|---|")
    for name in configs:
        own = name.split()[0] + " none"
        row = [name]
        for kind in ("grounded", "open"):
            r, o = statistics.median(rates[name][kind]), statistics.median(rates[own][kind])
            row += [f"{r:.1f}", f"{r / o:.2f}"]
        same = sum(texts[name][key] == texts[own][key] for key in texts[name])
        row.append("" if name == own else f"{same} of {len(texts[name])}")
        print("| " + " | ".join(row) + " |")
    print(f"\nCommand: python scripts/bench_speculation_server.py {' '.join(sys.argv[1:])}; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
