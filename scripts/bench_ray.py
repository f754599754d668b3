"""Engine replicas on Ray Serve, measured: prefix hit rate by routing, Ray's overhead, failover and autoscaling.

Usage: .venv/bin/python scripts/bench_ray.py [--only hit,overhead,failover,autoscale] [--requests-per-prompt 32]

Needs the ray extra (pip install -e '.[ray]'). Each part starts its own servers on loopback (a local Ray cluster
of this machine's CPUs, engine replicas of 1 thread each unless said) and stops them, then one table is printed:
- hit: 8 system prompts of 300 tokens x 32 user turns each, shuffled, concurrency 8, 4 tokens out: cached prompt
  tokens / prompt tokens with affinity routing (2 replicas), with Serve's pow2 (2 replicas), and on one process.
- overhead: output tokens/s at concurrency 8 (128-token prompts, 64 out) of 1 Ray replica with 2 threads against
  the plain server (2 threads), after a warm-up of each.
- failover: 2 replicas under streamed and whole-answer load; one replica gets SIGKILL mid-load. Reports hung
  clients, failures against that replica's sequences in flight at the kill, whether every failure is a 503
  engine_unavailable, and whether every request sent after the kill succeeded.
- autoscale: `--replicas auto` 1..2 under a load step (concurrency 16), then idle: replicas seen, failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from waferscale.bench import make_prompt
from waferscale.bench import run as bench_run
from waferscale.local_server import served

MODEL = "smollm2-135m-instruct"
WAFERSCALE = [sys.executable, "-m", "waferscale", "serve", "--shutdown-grace", "5"]
RAY2 = ["--replicas", "2", "--replica-threads", "1"]


def metrics(url: str) -> dict[str, float]:
    """/metrics as {series: value} (labels kept in the key)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def replicas_seen(url: str) -> int:
    return int(metrics(url).get("waferscale_replicas", 0))


async def hit_rate(url: str, per_prompt: int) -> dict:
    """Cached / prompt tokens over 8 system prompts x `per_prompt` user turns, shuffled, concurrency 8."""
    systems = [make_prompt(300, 1000 + s) for s in range(8)]
    bodies = [
        {"model": MODEL, "prompt": f"{systems[s]}\nUser turn {j}: {make_prompt(20, j)}\nAnswer:", "max_tokens": 4}
        for s in range(8)
        for j in range(per_prompt)
    ]
    random.Random(7).shuffle(bodies)
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    cached = prompt = errors = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal cached, prompt, errors
        while not queue.empty():
            r = await client.post("/v1/completions", json=queue.get_nowait())
            if r.status_code != 200:
                errors += 1
                continue
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(8)))
    return {"hit": cached / max(prompt, 1), "mean_prompt": prompt / max(len(bodies) - errors, 1),
            "errors": errors, "wall": time.perf_counter() - t0}  # fmt: skip


async def overhead_load(url: str) -> dict:
    await bench_run(url, MODEL, 8, 8, 128, 16, None, salt=10_000)  # warm-up: kernels, oneDNN shapes
    return await bench_run(url, MODEL, 8, 32, 128, 64, None)


async def one_request(client: httpx.AsyncClient, i: int, stream: bool) -> tuple[str, float]:
    """('ok' | 'HTTP 503 engine_unavailable' | ..., start time) of one completion, streamed or whole."""
    body = {"model": MODEL, "prompt": make_prompt(64, 5000 + i), "max_tokens": 96, "temperature": 0}
    started = time.monotonic()
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            return ("ok" if r.status_code == 200 else f"HTTP {r.status_code} {code}"), started
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}", started
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    err = json.loads(line[6:])
                    return f"chunk {err['status_code']} {err['error'].get('code')}", started
        return "ok", started
    except httpx.TimeoutException:
        return "hung", started
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}", started


async def failover(url: str) -> dict:
    """Mixed load at concurrency 8; SIGKILL the replica with the most sequences in flight after 4 s."""
    results: list[tuple[str, float]] = []
    killed: dict = {}

    async def worker(client: httpx.AsyncClient, k: int) -> None:
        for n in range(5):
            i = k * 5 + n
            results.append(await one_request(client, i, stream=i % 2 == 0))

    async def killer() -> None:
        await asyncio.sleep(4)
        m = metrics(url)
        info = {k: v for k, v in m.items() if k.startswith("waferscale_replica_info{")}
        best = None
        for key in info:
            labels = dict(part.split("=") for part in key[key.index("{") + 1 : -1].split(","))
            rid, pid = labels["replica"].strip('"'), int(labels["pid"].strip('"'))
            load = m.get(f'waferscale_replica_running{{replica="{rid}"}}', 0) + m.get(
                f'waferscale_replica_waiting{{replica="{rid}"}}', 0
            )
            if best is None or load > best[2]:
                best = (rid, pid, load)
        os.kill(best[1], signal.SIGKILL)
        killed.update(replica=best[0], in_flight=best[2], at=time.monotonic())

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(killer(), *(worker(client, k) for k in range(8)))
        after = await asyncio.gather(*(one_request(client, 900 + i, i % 2 == 0) for i in range(8)))
    failures = [r for r, _ in results if r != "ok"]
    late = [r for r, t in results + list(after) if t > killed["at"]]
    return {
        "requests": len(results) + len(after),
        "hung": sum(r == "hung" for r, _ in results + list(after)),
        "failures": len(failures),
        "in_flight": int(killed["in_flight"]),
        "all_503": all(r.endswith("503 engine_unavailable") for r in failures),
        "kinds": sorted(set(failures)),
        "after_ok": f"{sum(r == 'ok' for r in late)}/{len(late)}",
    }


async def autoscale(url: str) -> dict:
    """A load step (concurrency 16, 64 requests) then idle; replicas sampled every second."""
    seen: list[tuple[float, int]] = []
    t0 = time.monotonic()
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            seen.append((time.monotonic() - t0, replicas_seen(url)))
            await asyncio.sleep(1)

    sampler = asyncio.create_task(sample())
    load = await bench_run(url, MODEL, 16, 64, 64, 64, None)
    load_end = time.monotonic() - t0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and replicas_seen(url) != 1:
        await asyncio.sleep(2)
    done.set()
    await sampler
    up = next((t for t, n in seen if n >= 2), None)
    down = next((t for t, n in seen if t > load_end and n == 1), None)
    return {"max": max(n for _, n in seen), "up_at": up, "load_end": load_end, "back_to_1_at": down,
            "final": replicas_seen(url), "errors": load["errors"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="hit,overhead,failover,autoscale")
    p.add_argument("--requests-per-prompt", type=int, default=32)
    args = p.parse_args()
    parts = set(args.only.split(","))
    logs = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; logs in {logs}", file=sys.stderr)
    rows: list[tuple[str, str, str]] = []

    def add(*row: str) -> None:
        print("  ".join(row), file=sys.stderr, flush=True)  # as soon as measured; the table comes at the end
        rows.append(row)

    def serve(extra: list[str], label: str):
        return served([*WAFERSCALE, *extra], logs / f"{label}.log", label)

    if "hit" in parts:
        for label, extra in [
            ("affinity, 2 replicas", [*RAY2, "--routing", "affinity"]),
            ("pow2, 2 replicas", [*RAY2, "--routing", "pow2"]),
            ("single process", []),
        ]:
            with serve(extra, label.split(",")[0]) as (url, _):
                r = asyncio.run(hit_rate(url, args.requests_per_prompt))
            add("prefix hit rate", label, f"{r['hit']:.1%} cached of {r['mean_prompt']:.0f}-token "
                         f"prompts ({r['errors']} errors, {r['wall']:.0f} s)")  # fmt: skip
    if "overhead" in parts:
        figures = {}
        for label, extra in [("plain server", []), ("1 Ray replica x 2 threads", ["--replicas", "1",
                                                                                 "--replica-threads", "2"])]:
            with serve(extra, label.split()[0]) as (url, _):
                figures[label] = asyncio.run(overhead_load(url))
            add("overhead", label, f"{figures[label]['output_tok_s']:.1f} output tok/s "
                         f"(errors {figures[label]['errors']})")  # fmt: skip
        a, b = (figures[k]["output_tok_s"] for k in figures)
        add("overhead", "Ray vs plain", f"{(b - a) / a:+.1%}")
    if "failover" in parts:
        with serve(RAY2, "failover") as (url, _):
            r = asyncio.run(failover(url))
        add("failover", "SIGKILL 1 of 2 replicas", f"{r['failures']} failed of {r['requests']} "
                     f"(killed replica had {r['in_flight']} in flight), hung {r['hung']}, all 503: {r['all_503']} "
                     f"{r['kinds']}, after the kill ok: {r['after_ok']}")  # fmt: skip
    if "autoscale" in parts:
        extra = ["--replicas", "auto", "--min-replicas", "1", "--max-replicas", "2", "--replica-threads", "1",
                 "--downscale-delay", "15"]  # fmt: skip
        with serve(extra, "autoscale") as (url, _):
            r = asyncio.run(autoscale(url))
        fmt = lambda t: "never" if t is None else f"{t:.0f} s"  # noqa: E731
        add("autoscale", "1..2, load step c=16", f"max {r['max']} replicas (2 at {fmt(r['up_at'])}), "
                     f"load ended {r['load_end']:.0f} s, back to 1 at {fmt(r['back_to_1_at'])}, final "
                     f"{r['final']}, failed requests {r['errors']}")  # fmt: skip
    width = max(len(r[1]) for r in rows)
    for part, label, value in rows:
        print(f"{part:<16} {label:<{width}}  {value}")


if __name__ == "__main__":
    main()
