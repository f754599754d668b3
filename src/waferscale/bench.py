"""`waferscale bench`: a load generator for any OpenAI-compatible /v1/completions server.

Sends `--requests` streamed completions at `--concurrency`, each with a prompt of `--prompt-tokens` tokens (exact for
SmolLM2's tokenizer, about that for others) and exactly `--output-tokens` generated (min_tokens = max_tokens), and
prints output tokens/s, requests/s, time to first token and inter-token latency percentiles, and errors.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from old oak trees".split()


def make_prompt(tokens: int, salt: int) -> str:
    """`tokens` tokens of plain words, distinct per salt: each word is one SmolLM2 token, and so is each digit."""
    header = f"Request {salt}: "  # 'Request', ' ', one token per digit, ':'
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(max(1, tokens - 3 - len(str(salt))))]
    return header + " ".join(words)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    output_tokens: int,
    api_key: str | None,
    prefix: str = "",
    extra_body: dict | None = None,
    salt: int = 0,
) -> dict:
    """Figures for `requests` streamed completions at `concurrency`; request i's prompt is prefix + make_prompt(salt+i).

    `extra_body` adds fields to every request body (a None value drops a default field such as min_tokens), so one
    run can speak to servers that spell "generate exactly N tokens" differently.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ttfts: list[float] = []
    itls: list[float] = []
    latencies: list[float] = []
    decode_rates: list[float] = []
    prompt_counts: list[int] = []
    tokens = errors = cached = resent = 0
    first_error = ""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def send(client: httpx.AsyncClient, body: dict) -> tuple[str, bool]:
        """Stream one completion and record its figures: ('', _) when it finished, else (error, may resend).

        A request may be resent only when the connection failed before any response: a server that closes a
        kept-alive connection as the client reuses it (llama-server does, now and then) never saw the request.
        """
        nonlocal tokens, cached
        start = time.perf_counter()
        first = last = None
        generated = 0
        responded = False
        try:
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                responded = True
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {(await r.aread())[:300]!r}", False
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return str(chunk["error"])[:300], False
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        generated = usage["completion_tokens"]
                        tokens += generated
                        prompt_counts.append(usage.get("prompt_tokens", 0))
                        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        now = time.perf_counter()
                        if last is None:
                            ttfts.append(now - start)
                            first = now
                        else:
                            itls.append(now - last)
                        last = now
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}", not responded and isinstance(exc, httpx.TransportError)
        latencies.append(time.perf_counter() - start)
        if first is not None and last is not None and last > first and generated > 1:
            decode_rates.append((generated - 1) / (last - first))
        return "", False

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors, resent, first_error
        while not queue.empty():
            i = queue.get_nowait()
            body = {
                "model": model,
                "prompt": prefix + make_prompt(prompt_tokens, salt + i),
                "max_tokens": output_tokens,
                "min_tokens": output_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for key, value in (extra_body or {}).items():
                if value is None:
                    body.pop(key, None)
                else:
                    body[key] = value
            error, may_resend = await send(client, body)
            if error and may_resend:
                resent += 1
                error, _ = await send(client, body)
            if error:
                errors += 1
                first_error = first_error or error

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
        "resent": resent,
        "completion_tokens": tokens,
        "prompt_tokens_measured": _median([float(n) for n in prompt_counts]),
        "cached_tokens": cached,
        "latency_p50_ms": _median(latencies) * 1e3,
        "decode_tok_s_p50": _median(decode_rates),
        "first_error": first_error,
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
