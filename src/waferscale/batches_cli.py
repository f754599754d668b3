"""`waferscale batches`: the key's batches on a running server, newest first, with a progress bar for each one
still running; `--watch` redraws until none is."""

from __future__ import annotations

import os
import sys
import time

RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
BAR = 24


def progress(counts: dict | None, width: int = BAR) -> str:
    """`[#####.....]  done/total (n failed)` from a batch's request_counts."""
    counts = counts or {}
    total, done, failed = counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0)
    if not total:
        return "[" + "." * width + "]  counting requests"
    filled = min(width, (done + failed) * width // total)
    text = f"[{'#' * filled}{'.' * (width - filled)}] {done + failed:>6}/{total}"
    return text + (f" ({failed} failed)" if failed else "")


def format_batches(batches: list[dict], now: float | None = None) -> str:
    """One line a batch: id, status, age, requests; a progress bar for the running ones."""
    if not batches:
        return "no batches"
    now = time.time() if now is None else now
    lines = []
    for b in batches:
        counts = b.get("request_counts") or {}
        age = _age(now - b["created_at"])
        if b["status"] in RUNNING:
            detail = progress(counts)
        else:
            detail = f"{counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed of {counts.get('total', 0)}"
        lines.append([b["id"], b["status"], age, detail])
    widths = [max(len(row[i]) for row in lines) for i in range(3)]
    return "\n".join(
        "  ".join([row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]), row[3]])
        for row in lines
    )


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def fetch(url: str, key: str | None, limit: int) -> list[dict]:
    """The newest `limit` batches of the key, following has_more."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[dict] = []
    after = None
    while len(out) < limit:
        params = {"limit": min(100, limit - len(out)), **({"after": after} if after else {})}
        r = httpx.get(url.rstrip("/") + "/v1/batches", params=params, headers=headers, timeout=30)
        if r.status_code == 401:
            raise SystemExit("waferscale: error: the server wants a key: pass --api-key KEY")
        if r.status_code != 200:
            raise SystemExit(f"waferscale: error: {url}/v1/batches answered {r.status_code}: {r.text[:200]}")
        page = r.json()
        out += page["data"]
        if not page.get("has_more") or not page["data"]:
            break
        after = page["data"][-1]["id"]
    return out


def main(args) -> None:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    key = args.api_key or (os.environ.get("WAFERSCALE_API_KEY") or "").split(",")[0].strip() or None
    while True:
        try:
            batches = fetch(args.url, key, args.limit)
        except httpx.HTTPError as exc:
            print(f"waferscale: error: cannot reach {args.url}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        text = format_batches(batches)
        if args.watch and sys.stdout.isatty():
            sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
        print(text, flush=True)
        if not args.watch or not any(b["status"] in RUNNING for b in batches):
            return
        time.sleep(args.watch)
