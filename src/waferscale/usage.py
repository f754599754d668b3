"""`waferscale usage`: each key's requests, tokens and 429s, read from a running server's /metrics."""

from __future__ import annotations

import os
import sys

from prometheus_client.parser import text_string_to_metric_families

from waferscale.api.metrics import PREFIX, USAGE

COLUMNS = {  # KeyUsage field -> column heading
    "requests": "requests",
    "rate_limited": "429s",
    "prompt_tokens": "prompt",
    "cached_tokens": "cached",
    "completion_tokens": "completion",
}


def parse_usage(text: str) -> dict[str, dict[str, int]]:
    """{key name: {KeyUsage field: count}} from Prometheus text (the waferscale_key_* counters)."""
    fields = {PREFIX + name + "_total": field for field, (name, _) in USAGE.items()}
    rows: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = fields.get(sample.name)
            if field is not None:
                row = rows.setdefault(sample.labels["key"], dict.fromkeys(COLUMNS, 0))
                row[field] = int(sample.value)
    return rows


def format_table(rows: dict[str, dict[str, int]]) -> str:
    """A plain-text table, one line per key, sorted by name, with a total line when there are several keys."""
    lines = [["key", *COLUMNS.values()]]
    for name in sorted(rows):
        lines.append([name, *(str(rows[name][f]) for f in COLUMNS)])
    if len(rows) > 1:
        lines.append(["total", *(str(sum(r[f] for r in rows.values())) for f in COLUMNS)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )


def main(args) -> None:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # its request line is noise under the table

    key = args.api_key or (os.environ.get("WAFERSCALE_API_KEY") or "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"waferscale: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if r.status_code == 401:
        print("waferscale: error: the server wants a key: pass --api-key KEY", file=sys.stderr)
        raise SystemExit(1)
    if r.status_code != 200:
        print(f"waferscale: error: {args.url}/metrics answered {r.status_code}", file=sys.stderr)
        raise SystemExit(1)
    rows = parse_usage(r.text)
    print(format_table(rows) if rows else "no requests yet")
