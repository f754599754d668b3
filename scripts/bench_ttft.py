"""Time to first token of short, uncached chat prompts through a real server, this checkout against a git revision.

Usage: .venv/bin/python scripts/bench_ttft.py [--baseline REF] [--model NAME] [--requests 12] [--rounds 2]
                                             [--serve-arg ARG ...]

Each request is a streamed chat completion whose system message differs from every other request's and comes first,
so that nothing is found in the prefix cache; its time to first token is from sending the request to the first content chunk. The
servers run one at a time (this checkout, then the baseline, round after round), so that each has both cores; the
figures are each side's median over its rounds' requests. Only ratios measured in one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea and the wind that blows over it at night.",
    "Give me a short list of fruits that are red, and say which one you like best and why.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(src: Path, port: int, model: str | None, extra: list[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "waferscale", "serve", "--port", str(port), *(["--model", model] if model else []), *extra]
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server from {src} exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server from {src} did not start")


def first_token_ms(client: httpx.Client, model: str, n: int, question: str) -> float:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": f"Request {n}."}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return (time.perf_counter() - start) * 1e3
    raise RuntimeError("no content chunk")


def measure(src: Path, args, counter: list[int]) -> dict[str, list[float]]:
    port = free_port()
    proc = serve(src, port, args.model, args.serve_arg)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            out: dict[str, list[float]] = {q: [] for q in QUESTIONS}
            for i in range(2 + args.requests):
                for q in QUESTIONS:
                    counter[0] += 1
                    ms = first_token_ms(client, model, counter[0], q)
                    if i >= 2:  # the first two rounds warm the server up
                        out[q].append(ms)
            return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare against (default HEAD)")
    ap.add_argument("--model", default=None, help="the model to serve (default: the built-in one)")
    ap.add_argument("--requests", type=int, default=12, help="timed requests per question per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for `waferscale serve`")
    args = ap.parse_args()
    counter = [0]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.baseline], check=True)
        try:
            sides = {"this checkout": ROOT / "src", args.baseline: base / "src"}
            times: dict[str, dict[str, list[float]]] = {s: {q: [] for q in QUESTIONS} for s in sides}
            for _ in range(args.rounds):
                for side, src in sides.items():
                    for q, ms in measure(src, args, counter).items():
                        times[side][q] += ms
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"median time to first token, ms ({args.rounds} rounds x {args.requests} requests each):")
    print(f"{'question':<40} " + " ".join(f"{s[:14]:>14}" for s in sides) + "     ratio")
    for q in QUESTIONS:
        med = [statistics.median(times[s][q]) for s in sides]
        print(f"{q[:40]:<40} " + " ".join(f"{m:14.1f}" for m in med) + f"  {med[0] / med[1]:8.2f}")


if __name__ == "__main__":
    main()
