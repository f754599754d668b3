"""Batch figures against a fresh `waferscale serve` on loopback (its own temporary --data-dir); prints them.

Usage: .venv/bin/python scripts/bench_batch.py [--requests 200] [--max-tokens 16] [--concurrency 64]
                                               [--upload-mb 200] [--probes 8] [--serve-arg ARG ...]

1. Upload: a JSONL file of --upload-mb MB through POST /v1/files; the server's RSS before and after (VmRSS) and its
   peak (VmHWM) over the upload.
2. Throughput: the same --requests chat requests, first as one batch (created to completed), then as concurrent
   interactive requests (--concurrency at a time, the batch runner's default), alternated --rounds times; the
   ratio of the two rates.
3. Interference: --probes streamed single requests one after another on the idle server, then the same while a
   batch of the same --requests runs; time to first token and inter-token p50 of each.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL, Server  # noqa: E402  (the tests' server launcher)


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of pid in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":")
            out[name] = int(value.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def chat_line(i: int, max_tokens: int) -> dict:
    return {
        "custom_id": f"r{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}],
            "max_completion_tokens": max_tokens,
            "min_completion_tokens": max_tokens,
            "temperature": 0,
        },
    }


def without_min(body: dict) -> dict:
    """The body without min_completion_tokens (the OpenAI SDK sends it through extra_body)."""
    return {k: v for k, v in body.items() if k != "min_completion_tokens"}


class Filler(io.RawIOBase):
    """`size` bytes of valid JSONL, made as they are read (the client never holds the file either)."""

    def __init__(self, size: int):
        self.left = size
        self.line = (json.dumps(chat_line(0, 1)) + "\n").encode()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        chunk = (self.line * (n // len(self.line) + 1))[:n]
        b[:n] = chunk
        self.left -= n
        return n


def upload_figures(server: Server, mb: int) -> None:
    import httpx

    size = mb * 1_000_000
    before = rss(server.proc.pid)[0]
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    t = time.perf_counter()
    r = httpx.post(
        server.url + "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("big.jsonl", io.BufferedReader(Filler(size), 1 << 20), "application/jsonl")},
        timeout=600,
    )
    took = time.perf_counter() - t
    after, peak = rss(server.proc.pid)
    assert r.status_code == 200, r.text
    print(
        f"upload {mb} MB in {took:.1f} s: RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB, peak {peak / 2**20:.0f} "
        f"MiB (peak - before: {(peak - before) / 2**20:.1f} MiB)"
    )
    httpx.delete(server.url + f"/v1/files/{r.json()['id']}")


def run_batch(client, n: int, max_tokens: int) -> float:
    data = "".join(json.dumps(chat_line(i, max_tokens)) + "\n" for i in range(n)).encode()
    f = client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
    t = time.perf_counter()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        b = client.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == n, b
    lines = client.files.content(b.output_file_id).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(n))
    return time.perf_counter() - t


async def run_interactive(url: str, n: int, max_tokens: int, concurrency: int) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="unused", base_url=url + "/v1", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            body = chat_line(i, max_tokens)["body"]
            await client.chat.completions.create(
                **without_min(body), extra_body={"min_completion_tokens": max_tokens}
            )

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t


def probe(client, n: int) -> tuple[float, float]:
    """TTFT and inter-token p50 (ms) of n streamed single requests."""
    ttft, itl = [], []
    for i in range(n):
        t = time.perf_counter()
        stamps = []
        body = chat_line(10_000 + i, 16)["body"]
        stream = client.chat.completions.create(
            stream=True, **without_min(body), extra_body={"min_completion_tokens": 16}
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            info = (chunk.model_extra or {}).get("time_info")
            if info and os.environ.get("BENCH_VERBOSE"):
                print(
                    f"  probe {i}: queue_time {info['queue_time'] * 1000:.0f} ms, prompt_time "
                    f"{info['prompt_time'] * 1000:.0f} ms, total_time {info['total_time'] * 1000:.0f} ms (the run, from "
                    f"after planning); client: first content {(stamps[0] - t) * 1000:.0f} ms, end "
                    f"{(time.perf_counter() - t) * 1000:.0f} ms",
                    flush=True,
                )
        ttft.append(stamps[0] - t)
        itl += [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(ttft) * 1000, statistics.median(itl) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--upload-mb", type=int, default=200)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--serve-arg", action="append", default=[])
    args = p.parse_args()
    from openai import OpenAI

    with tempfile.TemporaryDirectory() as data:
        server = Server("--data-dir", data, "--max-upload-size", f"{args.upload_mb + 1}MB", *args.serve_arg)
        try:
            client = OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0, timeout=600)
            if args.upload_mb:
                upload_figures(server, args.upload_mb)
            run_batch(client, 10, 2)  # warm-up
            for _ in range(args.rounds):
                b = run_batch(client, args.requests, args.max_tokens)
                i = asyncio.run(run_interactive(server.url, args.requests, args.max_tokens, args.concurrency))
                print(
                    f"{args.requests} requests x {args.max_tokens} tokens: batch {b:.1f} s, interactive "
                    f"(concurrency {args.concurrency}) {i:.1f} s; batch throughput / interactive = {i / b:.2f}"
                )
            if args.probes:
                idle = probe(client, args.probes)
                import threading

                done = threading.Event()
                busy: list = []

                def background() -> None:
                    run_batch(client, args.requests, args.max_tokens)
                    done.set()

                threading.Thread(target=background, daemon=True).start()
                time.sleep(2)
                busy = probe(client, args.probes)
                print(
                    f"probes ({args.probes} x 16 tokens): idle TTFT p50 {idle[0]:.0f} ms, ITL p50 {idle[1]:.0f} ms; "
                    f"during a batch TTFT p50 {busy[0]:.0f} ms ({busy[0] / idle[0]:.2f}x), ITL p50 {busy[1]:.0f} ms "
                    f"({busy[1] / idle[1]:.2f}x); batch still running at the end: {not done.is_set()}"
                )
                done.wait(600)
        finally:
            server.stop()
    os.sys.stdout.flush()


if __name__ == "__main__":
    main()
