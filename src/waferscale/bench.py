"""`waferscale bench`: a load generator for any OpenAI-compatible /v1/completions server.

Sends `--requests` streamed completions at `--concurrency`, each with a prompt of about `--prompt-tokens` tokens and
exactly `--output-tokens` generated (min_tokens = max_tokens), and prints output tokens/s, requests/s, time to first
token and inter-token latency percentiles, and errors.
"""

from __future__ import annotations

import asyncio
import json
import time

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak trees".split()


def make_prompt(tokens: int, salt: int) -> str:
    """Roughly `tokens` tokens of plain words (about one token per word), distinct per request."""
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(max(1, tokens - 4))]
    return f"Request {salt}: " + " ".join(words)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def run(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    api_key: str | None,
    prefix: str = "",
) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prefix + make_prompt(prompt_tokens, i),
                "max_tokens": output_tokens,
                "min_tokens": output_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            last = None
            try:
                async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                    if r.status_code != 200:
                        errors += 1
                        await r.aread()
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors += 1
                            break
                        if chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            now = time.perf_counter()
                            if last is None:
                                ttfts.append(now - start)
                            else:
                                itls.append(now - last)
                            last = now
            except httpx.HTTPError:
                errors += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "req_s": (requests - errors) / wall,
        "ttft_p50_ms": pct(ttfts, 50) * 1e3,
        "ttft_p99_ms": pct(ttfts, 99) * 1e3,
        "itl_p50_ms": pct(itls, 50) * 1e3,
        "itl_p99_ms": pct(itls, 99) * 1e3,
        "errors": errors,
    }


def print_row(r: dict, header: bool = False) -> None:
    cols = [
        "concurrency",
        "requests",
        "prompt_tokens",
        "output_tokens",
        "output_tok_s",
        "req_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "errors",
    ]
    if header:
        print(" ".join(f"{c:>13}" for c in cols))
    print(" ".join(f"{r[c]:>13.1f}" if isinstance(r[c], float) else f"{r[c]:>13}" for c in cols))


def main(args) -> None:
    result = asyncio.run(
        run(
            args.url,
            args.model,
            args.concurrency,
            args.requests,
            args.prompt_tokens,
            args.output_tokens,
            args.api_key,
        )
    )
    print_row(result, header=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
