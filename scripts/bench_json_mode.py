"""Constrained decoding and a shared CPU, through a real server: decode tokens/s of plain, json_object, strict-schema
and tool-call requests, single stream and concurrent, on a quiet CPU and with other processes keeping cores busy.

Usage: .venv/bin/python scripts/bench_json_mode.py [--concurrency 16] [--tokens 96] [--runs 3] [--busy 1]
       [--threads N] [--speculative none] [--llamacpp] [--cache-dir DIR] [--env KEY=VALUE ...]

One server (waferscale serve, the built-in model) runs the whole table: first the quiet rows, then the same rows
while `--busy` processes spin (`while True: pass`), so the busy rows come after constrained requests. Each row is the
median over --runs of completion tokens / decode time (time_info.completion_time: prompt excluded; at concurrency c,
the c requests' tokens over the longest decode time among them). With --llamacpp, llama-server (built by
bench_vs_llamacpp.py, BF16 GGUF of the same model) runs the plain rows under the same load. Greedy decoding; a
machine shared with other work skews every figure, so compare rows of one run, never runs of different days.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import httpx

from waferscale.local_server import served

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "List ten animals with their weight, habitat and diet, as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "animals": {
            "type": "array",
            "minItems": 8,
            "maxItems": 10,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "weight_kg": {"type": "number", "minimum": 0},
                    "diet": {"type": "string", "enum": ["herbivore", "carnivore", "omnivore"]},
                },
                "required": ["name", "weight_kg", "diet"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["animals"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "save_animals", "strict": True, "parameters": SCHEMA},
}
MODES = {
    "plain": {},
    "json_object": {"response_format": {"type": "json_object"}},
    "strict schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "zoo", "strict": True, "schema": SCHEMA},
        }
    },
    "tool call": {"tools": [TOOL], "tool_choice": "required"},
    # the tool call's unconstrained twin: the same prompt (the tool's schema rendered into it: 301 tokens against
    # 44), so the tool call's ratio measures its grammar, not its longer context's attention
    "plain with tools": {"tools": [TOOL], "tool_choice": "none"},
}
BASELINE = {"tool call": "plain with tools"}  # what a mode's rate is compared with (else plain)


def spin() -> None:
    while True:
        pass


async def batch_rate(url: str, body: dict, concurrency: int) -> tuple[float, int]:
    """(decode tokens/s, tokens a request) of `concurrency` identical requests sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body) for _ in range(concurrency))
        )
        wall = time.perf_counter() - t0
    for a in answers:
        a.raise_for_status()
    bodies = [a.json() for a in answers]
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    # each request's decode time (waferscale: time_info.completion_time; llama-server: timings.predicted_ms); the
    # longest of the batch bounds its decode phase, so long prompts (tools in the prompt) do not count against it
    decode = max(
        (b.get("time_info") or {}).get("completion_time")
        or (b.get("timings") or {}).get("predicted_ms", 0) / 1000
        for b in bodies
    )
    return tokens / (decode or wall), tokens // concurrency


def measure(url: str, mode: str, concurrency: int, args) -> tuple[float, int]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": args.tokens, "temperature": 0, **MODES[mode]}
    if mode.startswith("plain"):  # exactly --tokens tokens
        body.update({"ignore_eos": True} if args.llama else {"min_tokens": args.tokens})
    rates = [asyncio.run(batch_rate(url, body, concurrency)) for _ in range(args.runs)]
    return statistics.median(r for r, _ in rates), rates[0][1]


def table(url: str, modes: list[str], args, label: str, busy: int) -> list[tuple[tuple, float]]:
    """((server, mode, concurrency, busy cores), tokens/s) for each mode at c=1 and c=--concurrency."""
    rows = []
    for concurrency in (1, args.concurrency):
        for mode in modes:
            rate, tokens = measure(url, mode, concurrency, args)
            name = f"{label}, {mode}, c={concurrency}" + (f", {busy} core(s) busy" if busy else "")
            print(f"  {name}: {rate:.1f} tok/s ({tokens} tokens a request)", file=sys.stderr)
            rows.append(((label, mode, concurrency, busy), rate))
    return rows


def run(argv: list[str], label: str, modes: list[str], args, log: Path) -> list[tuple[tuple, float]]:
    env = dict(kv.split("=", 1) for kv in args.env)
    args.llama = label == "llama-server"
    with served(argv, log, label, env=env) as (url, _):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 8}
        for mode in modes:  # warm-up: grammars compiled
            httpx.post(
                url + "/v1/chat/completions", json={**body, **MODES[mode]}, timeout=600
            ).raise_for_status()
        rows = table(url, modes, args, label, 0)
        if not args.busy:
            return rows
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
        for p in spinners:
            p.start()
        try:
            time.sleep(1)
            rows += table(url, modes, args, label, args.busy)
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes for the shared-CPU rows")
    ap.add_argument("--threads", type=int, help="waferscale serve --threads")
    ap.add_argument(
        "--speculative",
        help="waferscale serve --speculative (none: each mode's rate without its drafts' acceptance)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of the server")
    ap.add_argument("--llamacpp", action="store_true", help="also llama-server (plain rows), same load")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "waferscale-bench")
    ap.add_argument("--log-dir", type=Path, default=Path(".cache"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    argv = [str(Path(sys.executable).parent / "waferscale"), "serve"]
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += ["--speculative", args.speculative] if args.speculative else []
    rows = run(argv, "waferscale", modes, args, args.log_dir / "bench_json_mode-waferscale.log")
    if args.llamacpp:
        sys.path.insert(0, str(Path(__file__).parent))
        import bench_vs_llamacpp as lc

        cache = args.cache_dir.expanduser()
        binary, gguf = lc.llama_server_binary(cache), lc.bf16_gguf(cache, lc.llama_cpp_dir(cache))
        llama = [str(binary), "-m", str(gguf), *lc.LLAMA_ARGS]
        args.env = []
        rows += run(llama, "llama-server", ["plain"], args, args.log_dir / "bench_json_mode-llama.log")

    quiet = {(server, mode, c): rate for (server, mode, c, busy), rate in rows if not busy}
    print(
        f"| request ({args.tokens} tokens max, greedy, median of {args.runs}) | decode tok/s "
        "| vs plain (tool call: plain with the tools in its prompt), quiet |"
    )
    print("|---|---|---|")
    for (server, mode, c, busy), rate in rows:
        name = f"{server}, {mode}, c={c}" + (f", {busy} core(s) busy" if busy else "")
        base = quiet.get((server, BASELINE.get(mode, "plain"), c))
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x |" if base else f"| {name} | {rate:.1f} | |")


if __name__ == "__main__":
    main()
