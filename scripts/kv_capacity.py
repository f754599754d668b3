"""KV-cache capacity of a model: KB a token per layer kind, the longest sequence the pool holds, and how many
sequences of a given context fit, beside the figures of a cache where every layer keeps every block.

Usage: .venv/bin/python scripts/kv_capacity.py [--model gemma-3-270m] [--kv-cache-memory 512]
                                               [--kv-cache-dtype auto|bfloat16|float32|int8] [--run TOKENS]

--run feeds one prompt of TOKENS tokens (in chunks of 512) and 16 generated tokens through the engine and prints
the most pages it held, and the pages every layer keeping every block would take.
"""

from __future__ import annotations

import argparse
import logging

import torch

from waferscale.engine import LLMEngine, SamplingParams
from waferscale.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--kv-cache-memory", type=int, default=512, help="MiB")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8"])
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--run", type=int, default=0, help="tokens of one prompt to run through the engine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(args.model, progress=False)
    engine = LLMEngine(loaded, kv_cache_bytes=args.kv_cache_memory << 20, kv_cache_dtype=args.kv_cache_dtype)
    blocks, sched, bs = engine.blocks, engine.scheduler, engine.block_size
    pages = blocks.num_blocks - 1
    layers_per_page = engine.pool.layout.group_size
    every_layer = loaded.config.num_layers // layers_per_page  # pages a block of every layer takes
    print(f"pool: {pages} pages of {bs} tokens x {layers_per_page} layers")
    print(f"every layer every block: one sequence fits {pages // every_layer * bs} tokens")
    print("context  pages a sequence (peak / decoding)  sequences that fit (peak / decoding)  every layer every block")
    for ctx in (int(c) for c in args.contexts.split(",")):
        peak = sched.sequence_pages(ctx)
        decoding = sum(
            (-(-ctx // bs) if k.window is None else min(-(-ctx // bs), -(-k.window // bs) + 1)) * k.pages
            for k in blocks.kinds
        )
        full = -(-ctx // bs) * every_layer
        print(f"{ctx:7d}  {peak:6d} / {decoding:6d}  {pages // peak:6d} / {pages // decoding:6d}  {pages // full:6d}")
    if args.run:
        ids = torch.randint(100, 20000, (args.run,), generator=torch.Generator().manual_seed(0)).tolist()
        engine.add_request("r", ids, SamplingParams(max_tokens=16, min_tokens=16, temperature=0))
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, blocks.num_used)
        print(f"ran {args.run} + 16 tokens: held at most {most} pages; every layer every block: "
              f"{-(-(args.run + 16) // bs) * every_layer}")


if __name__ == "__main__":
    main()
