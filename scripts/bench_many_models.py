"""Several models in one server, measured: each model's single-stream rate beside the other against served alone,
16 interleaved concurrent requests, and swaps under a budget that holds one model at a time (RSS after each load,
time to first token cold and warm).

Usage: .venv/bin/python scripts/bench_many_models.py [--tokens 64] [--runs 5] [--swaps 20] [--budget 460MiB]
       [--kv-cache-memory 64MiB] [--models smollm2-135m-instruct,gemma-3-270m]

Servers run one after another (each model alone, both together, both under --budget) on the same machine in one run;
rates are completion tokens / decode time (time_info.completion_time), the median of --runs greedy completions of
exactly --tokens tokens. A machine shared with other work skews every figure: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

from waferscale.local_server import served

PROMPT = "The history of the printing press begins"


def rss_mib(pid: int) -> float:
    """The process's resident memory now (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def body(model: str, tokens: int, **extra) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 0,
        **extra,
    }


def rate(url: str, model: str, tokens: int) -> float:
    """Decode tokens/s of one greedy completion of exactly `tokens` tokens."""
    r = httpx.post(url + "/v1/completions", json=body(model, tokens), timeout=600)
    r.raise_for_status()
    out = r.json()
    return out["usage"]["completion_tokens"] / out["time_info"]["completion_time"]


def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first text."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body(model, 4, stream=True), timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first = time.perf_counter() - t0
                break
        else:
            raise RuntimeError(f"{model}: no text in the stream")
        for _ in lines:  # the rest of the stream
            pass
    return first


def rates(url: str, models: list[str], args) -> dict[str, float]:
    """Median single-stream rate of each model, requests alternated between the models."""
    seen: dict[str, list[float]] = {m: [] for m in models}
    for _ in range(args.runs):
        for m in models:
            seen[m].append(rate(url, m, args.tokens))
    return {m: statistics.median(v) for m, v in seen.items()}


async def interleaved(url: str, models: list[str], n: int, tokens: int) -> int:
    """How many of `n` concurrent completions, alternating between the models, were answered in full."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/completions", json=body(models[i % len(models)], tokens)) for i in range(n)),
            return_exceptions=True,
        )
    return sum(
        1 for a in answers
        if isinstance(a, httpx.Response) and a.status_code == 200 and a.json()["usage"]["completion_tokens"] == tokens
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--swaps", type=int, default=20)
    ap.add_argument(
        "--budget",
        default="460MiB",
        help="--memory-budget that holds one model at a time (the built-in model held 178 MiB, Gemma 3 270M 420)",
    )
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--log-dir", type=Path, default=Path(".cache"))
    args = ap.parse_args()
    models = args.models.split(",")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    exe = str(Path(sys.executable).parent / "waferscale")
    common = [exe, "serve", "--kv-cache-memory", args.kv_cache_memory]
    both = [arg for m in models for arg in ("--model", m)]

    alone = {}
    for m in models:
        with served([*common, "--model", m], args.log_dir / f"many-alone-{m}.log", f"{m} alone") as (url, _):
            rate(url, m, 8)  # warm-up
            alone.update(rates(url, [m], args))

    with served([*common, *both], args.log_dir / "many-both.log", "both models") as (url, _):
        for m in models:
            rate(url, m, 8)  # loads each, warms up
        together = rates(url, models, args)
        answered = asyncio.run(interleaved(url, models, 16, args.tokens))

    swaps, cold, warm, failed = [], [], [], 0
    budget = [*common, *both, "--memory-budget", args.budget]
    with served(budget, args.log_dir / "many-budget.log", f"both models, budget {args.budget}") as (
        url,
        proc,
    ):
        for i in range(args.swaps + 1):
            m = models[i % len(models)]
            try:
                cold.append(first_token_s(url, m))  # the other model is loaded: this one loads first
                warm.append(first_token_s(url, m))
            except (httpx.HTTPError, RuntimeError) as exc:
                failed += 1
                print(f"  swap {i} ({m}) failed: {exc}", file=sys.stderr)
                continue
            health = httpx.get(url + "/health", timeout=30).json()["models"]
            loaded = sorted(k for k, v in health.items() if v["state"] == "loaded")
            swaps.append((m, rss_mib(proc.pid), loaded))
            print(f"  swap {i}: {m}, RSS {swaps[-1][1]:.0f} MiB, loaded {loaded}", file=sys.stderr)

    print(f"\nsingle stream, {args.tokens} tokens, median of {args.runs} (tokens/s):")
    print("| model | alone | beside the other | ratio |\n|---|---:|---:|---:|")
    for m in models:
        print(f"| {m} | {alone[m]:.1f} | {together[m]:.1f} | {together[m] / alone[m]:.2f}x |")
    print(f"\n16 concurrent completions alternating between the models: {answered}/16 answered in full")
    print(f"\n{args.swaps} swaps under --memory-budget {args.budget}: {failed} failed; "
          f"one model loaded after each: {all(len(s[2]) == 1 for s in swaps)}")  # fmt: skip
    print("| model | RSS after its first load (MiB) | after its later loads: min / max | largest change |")
    print("|---|---:|---:|---:|")
    for m in models:
        seen = [r for (name, r, _) in swaps if name == m]
        if seen:
            drift = max(abs(r - seen[0]) for r in seen)
            print(
                f"| {m} | {seen[0]:.0f} | {min(seen[1:] or seen):.0f} / {max(seen[1:] or seen):.0f} | {drift:.0f} |"
            )
    print(f"\ntime to first token: cold (the model loads first) median {statistics.median(cold):.2f} s "
          f"(min {min(cold):.2f}, max {max(cold):.2f}); warm median {statistics.median(warm) * 1000:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
