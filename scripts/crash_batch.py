"""Crash test: SIGKILL a server --kills times at random points of a --requests batch, restarting it on the same
--data-dir each time; then check the batch completed with every custom_id answered exactly once and the database
passes PRAGMA integrity_check. Prints what it saw; exit status 0 when every check passes.

Usage: .venv/bin/python scripts/crash_batch.py [--requests 500] [--kills 5] [--max-tokens 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL, Server  # noqa: E402  (the tests' server launcher)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from openai import OpenAI

    rng = random.Random(args.seed)
    n = args.requests
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say something about {i}."}],
                "max_completion_tokens": args.max_tokens,
            },
        }
        for i in range(n)
    ]
    with tempfile.TemporaryDirectory() as data:
        start = ("--data-dir", data)
        server = Server(*start)
        t0 = time.time()
        try:
            client = OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0, timeout=60)
            body = "".join(json.dumps(x) + "\n" for x in lines).encode()
            f = client.files.create(file=("crash.jsonl", io.BytesIO(body)), purpose="batch")
            batch = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            marks = sorted(rng.sample(range(1, n), args.kills))  # kill once this many requests have completed
            for mark in marks:
                while client.batches.retrieve(batch.id).request_counts.completed < mark:
                    time.sleep(0.05)
                done = client.batches.retrieve(batch.id).request_counts.completed
                server.proc.kill()
                server.proc.wait()
                server._log.close()
                print(f"SIGKILL at {done}/{n} completed ({time.time() - t0:.0f} s)", flush=True)
                server = Server(*start)
                client = OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0, timeout=60)
            while (b := client.batches.retrieve(batch.id)).status not in (
                "completed",
                "failed",
                "cancelled",
                "expired",
            ):
                time.sleep(0.5)
            ids = [
                json.loads(x)["custom_id"] for x in client.files.content(b.output_file_id).text.splitlines()
            ]
            errors = client.files.content(b.error_file_id).text.splitlines() if b.error_file_id else []
        finally:
            server.stop()
        integrity = (
            sqlite3.connect(Path(data) / "waferscale.sqlite3").execute("PRAGMA integrity_check").fetchone()[0]
        )
    ok = b.status == "completed" and sorted(ids) == sorted(x["custom_id"] for x in lines) and not errors
    print(
        f"status {b.status}, {b.request_counts.completed}/{n} completed, {len(ids)} output lines, "
        f"{len(set(ids))} distinct custom_ids, {len(errors)} error lines, integrity_check {integrity}, "
        f"{time.time() - t0:.0f} s: {'PASS' if ok and integrity == 'ok' else 'FAIL'}"
    )
    raise SystemExit(0 if ok and integrity == "ok" else 1)


if __name__ == "__main__":
    main()
