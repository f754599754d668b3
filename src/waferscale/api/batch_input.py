"""Checking a batch's input file line by line, before any request runs: every problem found is reported with its
line number in the batch's `errors` (OpenAI's list shape), and a file with any problem fails the whole batch."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

MAX_ERRORS = 100  # listed in `errors`; the rest are counted in the last entry's message


@dataclass
class Checked:
    count: int = 0
    model: str | None = None
    errors: list[dict] = field(default_factory=list)
    more_errors: int = 0

    def error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})
        else:
            self.more_errors += 1


def lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line without its end of line) for every non-blank line; read in a stream."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.rstrip(b"\n").rstrip(b"\r")
            if line.strip():
                yield number, line


def parse_line(number: int, raw: bytes, endpoint: str, max_line_bytes: int, out: Checked) -> dict | None:
    """The line's request object, or None with its problem added to `out`."""
    if len(raw) > max_line_bytes:
        out.error("line_too_long", f"line is {len(raw)} bytes; the limit is {max_line_bytes}", number)
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        out.error("invalid_encoding", "line is not UTF-8", number)
        return None
    except ValueError as exc:
        out.error("invalid_json_line", f"line is not valid JSON ({exc})", number)
        return None
    if not isinstance(obj, dict):
        out.error(
            "invalid_json_line", "line must be a JSON object with custom_id, method, url and body", number
        )
        return None
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        out.error("missing_required_parameter", "custom_id must be a non-empty string", number, "custom_id")
        return None
    if obj.get("method") != "POST":
        out.error("invalid_method", f"method must be 'POST' (got {obj.get('method')!r})", number, "method")
        return None
    if obj.get("url") != endpoint:
        out.error(
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint!r} (got {obj.get('url')!r})",
            number,
            "url",
        )
        return None
    body = obj.get("body")
    if not isinstance(body, dict):
        out.error("invalid_body", "body must be a JSON object: the request's parameters", number, "body")
        return None
    return obj


def check_file(
    path: Path,
    endpoint: str,
    *,
    max_line_bytes: int,
    min_requests: int,
    max_requests: int,
    served: Callable[[str], bool],
) -> Checked:
    """Every line checked: its shape, a unique custom_id, one served model for all lines, no streaming; then the
    number of requests against the limits."""
    out = Checked()
    seen: set[str] = set()
    for number, raw in lines(path):
        out.count += 1
        obj = parse_line(number, raw, endpoint, max_line_bytes, out)
        if obj is None:
            continue
        custom_id, body = obj["custom_id"], obj["body"]
        if custom_id in seen:
            out.error(
                "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once", number, "custom_id"
            )
        seen.add(custom_id)
        model = body.get("model")
        if not isinstance(model, str):
            out.error("missing_required_parameter", "body.model must name the model", number, "body.model")
        elif not served(model):
            out.error("model_not_found", f"model {model!r} is not served here", number, "body.model")
        elif out.model is None:
            out.model = model
        elif model != out.model:
            out.error(
                "mixed_models", f"every request of a batch must use one model: {out.model!r}, not {model!r}",
                number, "body.model",
            )  # fmt: skip
        if body.get("stream"):
            out.error(
                "stream_unsupported",
                "a batch request cannot stream; remove body.stream",
                number,
                "body.stream",
            )
    if out.count < min_requests:
        out.error(
            "too_few_requests",
            f"the file has {out.count} requests; a batch needs at least {min_requests}",
            None,
        )
    if out.count > max_requests:
        out.error(
            "too_many_requests",
            f"the file has {out.count} requests; a batch holds at most {max_requests}: split it into several",
            None,
        )
    if out.more_errors:
        out.errors[-1]["message"] += f" (and {out.more_errors} more errors not listed)"
    return out


def request_rows(path: Path, chunk: int = 1000) -> Iterator[list[tuple[int, str, str]]]:
    """(line, custom_id, body JSON) of a file that passed check_file, `chunk` rows at a time."""
    rows: list[tuple[int, str, str]] = []
    for number, raw in lines(path):
        obj = json.loads(raw.decode("utf-8"))
        rows.append(
            (number, obj["custom_id"], json.dumps(obj["body"], separators=(",", ":"), ensure_ascii=False))
        )
        if len(rows) >= chunk:
            yield rows
            rows = []
    if rows:
        yield rows
