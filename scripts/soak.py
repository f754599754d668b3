"""Soak test: many mixed requests at high concurrency against a fresh `waferscale serve` on loopback; prints figures.

Usage: .venv/bin/python scripts/soak.py [--requests 2000] [--concurrency 32] [--max-tokens 8] [--path PATH ...]
                                        [--serve-arg ARG ...]

The mix (seeded, reproducible): streaming and not, n 1-3, logprobs on and off, temperatures 0/0.7/1.0, 10% of all
clients hanging up after their first chunk, 5% invalid requests. A warm-up of the same mix comes first. Checks and
prints: no 5xx; every valid request ends complete (or hung up by its client) and every invalid one with a 4xx; server
RSS after the run within --max-growth percent (5) of after warm-up; no sequence running or waiting and no KV block in
use afterwards (blocks kept for the prefix cache are counted apart); the run's wall time; RSS at every tenth of the
run (a plateau and a leak look different there). Exit status 0 when every check passes on every path.

`--path` forces one of the CPU paths the kernels choose, each on its own fresh server (repeatable; `all` runs each):
native (the default: the built-in model's Q4_1/Q8_0 blocks through the native quantized kernels), bf16
(--quantization none: weights dequantized to bf16, native bf16 kernels where they can be built; on CPUs with bf16
in hardware they take batches of up to 16 rows and oneDNN the rest; a Hugging Face folder's default), torch
(WAFERSCALE_NATIVE_KERNELS=0: PyTorch ops only, a tile of the blocks dequantized at a time), float32 (--dtype
float32: weights dequantized to float32), no-amx (bf16 with oneDNN held below AMX by
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; the same as bf16 on CPUs without AMX).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from waferscale.local_server import proc_status, served

MODEL = "smollm2-135m-instruct"


def rss_mib(pid: int) -> float:
    rss = proc_status(pid, "VmRSS")
    return float("nan") if rss is None else rss / 2**20


async def metric(client, name: str) -> float:
    text = (await client.get("/metrics")).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def make_request(rng: random.Random, i: int, max_tokens: int) -> tuple[str, dict]:
    """(kind, body): kind is 'invalid', 'hangup', 'stream' or 'plain'."""
    if rng.random() < 0.05:
        bad = rng.choice(
            [
                {"temperature": -1},
                {"n": 0},
                {"prompt": [[-1]]},
                {"logprobs": 99},
                {"max_tokens": 10**9},
                {"model": "x"},
            ]
        )
        return "invalid", {"model": MODEL, "prompt": "hi", "max_tokens": 1, **bad}
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: tell me about the number {rng.randint(0, 10**6)}",
        "max_tokens": max_tokens,
        "n": rng.randint(1, 3),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": i,
    }
    if rng.random() < 0.5:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.5:
        body["stream"] = True
        return ("hangup" if rng.random() < 0.2 else "stream"), body  # 20% of half: 10% of all
    return "plain", body


async def one(client, kind: str, body: dict, tally: Counter) -> None:
    """Send one request and tally how it ended, keyed by its kind ('plain status 200', 'invalid status 400'...)."""
    try:
        if kind in ("stream", "hangup"):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    tally[f"{kind} status {r.status_code}"] += 1
                    return
                finished, error = 0, False
                async for line in r.aiter_lines():
                    if kind == "hangup":
                        tally["hangup after first chunk"] += 1
                        return  # leaving the block closes the connection mid-stream
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        error = error or "error" in chunk
                        finished += sum(1 for c in chunk.get("choices", []) if c.get("finish_reason"))
                    elif line == "data: [DONE]":
                        break
                complete = finished == body["n"]
                tally[
                    "stream complete"
                    if complete and not error
                    else "stream error"
                    if error
                    else "stream incomplete"
                ] += 1
        else:
            r = await client.post("/v1/completions", json=body)
            if kind == "plain" and r.status_code == 200:
                ok = len(r.json()["choices"]) == body["n"]
                tally["plain complete" if ok else "plain incomplete"] += 1
            else:
                tally[f"{kind} status {r.status_code}"] += 1
    except Exception as exc:  # a transport failure is a finding, not a crash of the soak
        tally[f"client {type(exc).__name__}"] += 1


PATHS = {  # name -> (extra `serve` arguments, extra environment)
    "native": ([], {}),
    "bf16": (["--quantization", "none"], {}),
    "torch": ([], {"WAFERSCALE_NATIVE_KERNELS": "0"}),
    "float32": (["--dtype", "float32"], {}),
    "no-amx": (["--quantization", "none"], {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
}


async def run_mix(client, plan: list[tuple[str, dict]], concurrency: int, on_done=None) -> Counter:
    """Run `plan` with `concurrency` clients, each taking the next request when its last one ends; `on_done(k)`
    after the k-th request ends."""
    tally: Counter = Counter()
    queue = list(reversed(plan))
    done = 0

    async def worker() -> None:
        nonlocal done
        while queue:
            kind, body = queue.pop()
            tally[f"sent {kind}"] += 1
            await one(client, kind, body, tally)
            done += 1
            if on_done is not None:
                on_done(done)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


async def soak(url: str, pid: int, requests: int, concurrency: int, max_tokens: int) -> dict:
    import httpx

    warm_rng, rng = random.Random(99), random.Random(1234)
    warmup = [make_request(warm_rng, i, max_tokens) for i in range(4 * concurrency)]
    plan = [make_request(rng, i, max_tokens) for i in range(requests)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await run_mix(
            client, warmup, concurrency
        )  # the same mix, so allocator pools are at their working size
        await asyncio.sleep(1.0)
        rss_warm = rss_mib(pid)
        trace: list[float] = []
        step = max(1, requests // 10)

        def sample(done: int) -> None:
            if done % step == 0:
                trace.append(round(rss_mib(pid)))
                rate = done / (time.perf_counter() - start)
                print(f"  {done}/{requests} requests, {rate:.1f}/s, RSS {trace[-1]} MiB", file=sys.stderr, flush=True)

        start = time.perf_counter()
        tally = await run_mix(client, plan, concurrency, sample)
        wall = time.perf_counter() - start
        await asyncio.sleep(1.0)  # hung-up streams are aborted at the engine's next step
        blocks_used = await metric(client, "waferscale_kv_blocks_used")
        blocks_cached = await metric(client, "waferscale_kv_blocks_cached")
        running = await metric(client, "waferscale_running")
        waiting = await metric(client, "waferscale_waiting")
        rss_end = rss_mib(pid)
    sent = sum(v for k, v in tally.items() if k.startswith("sent "))
    return {
        "requests": sent,
        "concurrency": concurrency,
        "wall_s": round(wall, 1),
        "requests_per_s": round(sent / wall, 2),
        "tally": dict(sorted(tally.items())),
        "server_5xx": sum(v for k, v in tally.items() if " status 5" in k),
        "rss_after_warmup_mib": round(rss_warm, 1),
        "rss_after_run_mib": round(rss_end, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 1),
        "rss_every_tenth_mib": trace,
        "rss_peak_mib": round((proc_status(pid, "VmHWM") or 0) / 2**20, 1),
        "kv_blocks_in_use_after": blocks_used,
        "kv_blocks_cached_after": blocks_cached,
        "running_after": running,
        "waiting_after": waiting,
    }


def passed(result: dict, max_growth: float) -> bool:
    """Every check of the module docstring."""
    tally = result["tally"]
    return (
        result["server_5xx"] == 0
        and result["kv_blocks_in_use_after"] == 0
        and result["running_after"] == 0
        and result["waiting_after"] == 0
        and result["rss_growth_pct"] < max_growth
        # every valid request ends complete (or hung up by its client), every invalid one with a 4xx
        and tally.get("plain complete", 0) == tally.get("sent plain", 0)
        and tally.get("stream complete", 0) == tally.get("sent stream", 0)
        and tally.get("hangup after first chunk", 0) == tally.get("sent hangup", 0)
        and sum(v for k, v in tally.items() if k.startswith("invalid status 4")) == tally.get("sent invalid", 0)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--path",
        action="append",
        choices=[*PATHS, "all"],
        help="CPU path to force (repeatable; default native; all: each in turn)",
    )
    ap.add_argument("--max-growth", type=float, default=5.0, help="RSS growth after warm-up that fails (percent)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for `waferscale serve`")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    paths = list(PATHS) if "all" in (args.path or []) else (args.path or ["native"])
    Path(".cache").mkdir(exist_ok=True)
    results, ok = {}, True
    for name in paths:
        extra_args, env = PATHS[name]
        cmd = [sys.executable, "-m", "waferscale", "serve", *extra_args, *args.serve_arg]
        log = Path(".cache") / f"soak-server-{name}.log"
        with served(cmd, log, f"waferscale ({name} path)", timeout=300, env=env) as (url, proc):
            result = asyncio.run(soak(url, proc.pid, args.requests, args.concurrency, args.max_tokens))
        result["verdict"] = "PASS" if passed(result, args.max_growth) else "FAIL"
        ok &= result["verdict"] == "PASS"
        results[name] = result
        print(f"path {name}: {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}")
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    print()
    print(f"{'path':<8} {'requests':>8} {'rss warm MiB':>12} {'rss end MiB':>11} {'growth %':>8} {'5xx':>4}  verdict")
    for name, r in results.items():
        print(
            f"{name:<8} {r['requests']:>8} {r['rss_after_warmup_mib']:>12} {r['rss_after_run_mib']:>11} "
            f"{r['rss_growth_pct']:>8} {r['server_5xx']:>4}  {r['verdict']}"
        )
    print("verdict:", "PASS" if ok else "FAIL")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
