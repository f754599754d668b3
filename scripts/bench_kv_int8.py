"""Decode step time at a long context with int8 KV against bfloat16 KV, and the tokens a pool holds.

Usage: .venv/bin/python scripts/bench_kv_int8.py [--model PATH] [--context 4096] [--batch 1,8] [--steps 20]
                                                 [--kv-cache-memory 512]

For each KV dtype (bfloat16, int8; float32 too with --float32): a pool holding `--batch` sequences of `--context`
tokens of random keys and values (int8: random bytes and scales), then `--steps` decode steps of the model (bf16,
the native kernels as the server runs them: the whole-layer decode call where the model has one) timed per step,
and the paged decode attention kernel alone over the same pool (every layer, one call each), which is the part
int8 KV shrinks. Also printed: the tokens a pool of --kv-cache-memory holds for each dtype (the engine's own
accounting: int8 values plus a float32 scale per token and KV head). Timings need a quiet machine; on a shared one
they are not figures to quote.
"""

from __future__ import annotations

import argparse
import time

import torch

from waferscale import kernels
from waferscale.engine import LLMEngine
from waferscale.engine.kv_cache import KVPool, PagedBatch
from waferscale.engine.llm_engine import kv_cache_dtypes
from waferscale.models import load_model

BS = 16


def _pool(cfg, kv: str, model_dtype, pages: int) -> KVPool:
    dtype, compute = kv_cache_dtypes(kv, model_dtype)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, pages, BS, compute_dtype=compute)
    if dtype == torch.int8:
        pool.k.random_(-127, 128)
        pool.v.random_(-127, 128)
        pool.k_scale.uniform_(0.005, 0.02)
        pool.v_scale.uniform_(0.005, 0.02)
    else:
        pool.k.normal_()
        pool.v.normal_()
    return pool


def _best_ms(fn, steps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]  # the median


def _measure(loaded, native, kv: str, batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median ms of a decode step of `batch` sequences at `context` tokens, and of the attention kernel alone."""
    cfg, model = loaded.config, loaded.model
    width = -(-(context + 1) // BS)
    pool = _pool(cfg, kv, loaded.dtype, 1 + batch * width)
    tables = torch.arange(1, 1 + batch * width).view(batch, width)
    lengths = torch.full((batch,), context + 1)
    last = lengths - 1
    slots = tables[torch.arange(batch), last // BS] * BS + last % BS
    ids = torch.randint(100, 20000, (batch,))
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim)

    def step():
        model(ids, last, PagedBatch(pool, slots, num_decode=batch, decode_tables=tables, decode_lengths=lengths,
                                    native=native))  # fmt: skip

    def attention():
        for layer in range(cfg.num_layers):
            c = pool.layer_kv(layer)
            native.paged_decode_attention(
                q, c.k, c.v, tables, lengths, cfg.head_dim**-0.5, BS, k_scale=c.k_scale, v_scale=c.v_scale
            )

    return _best_ms(step, steps), _best_ms(attention, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file or folder (default: the built-in model)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", default="1,8", help="sequences decoding at once (comma-separated)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-memory", type=int, default=512, help="MiB, for the tokens a pool holds")
    ap.add_argument("--float32", action="store_true", help="float32 KV too")
    args = ap.parse_args()
    native = kernels.load()
    if native is None:
        raise SystemExit("the native kernels could not be built: nothing to measure")
    loaded = load_model(args.model, dtype="bfloat16", progress=False)
    cfg = loaded.config
    dtypes = ["bfloat16", "int8"] + (["float32"] if args.float32 else [])
    print(f"model: {loaded.name} (bf16, {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of {cfg.head_dim})")
    print(f"\ntokens a {args.kv_cache_memory} MiB pool holds (every layer):")
    for kv in dtypes:
        engine = LLMEngine(loaded, kv_cache_bytes=args.kv_cache_memory << 20, kv_cache_dtype=kv)
        print(f"  {kv:<9} {engine.kv_cache_tokens:>9,d} tokens, {engine.pool.nbytes / 2**20:.0f} MiB")
        del engine
    print(f"\ndecode at {args.context} tokens of context, median of {args.steps} (ms)")
    print(f"{'batch':>5} {'KV dtype':<9} {'step':>8} {'attention':>10} {'step vs bf16':>13} {'attention vs bf16':>18}")
    for batch in (int(b) for b in args.batch.split(",")):
        base = None
        for kv in dtypes:
            step, attention = _measure(loaded, native, kv, batch, args.context, args.steps)
            base = base or (step, attention)
            print(f"{batch:>5} {kv:<9} {step:>8.2f} {attention:>10.2f} {base[0] / step:>12.2f}x "
                  f"{base[1] / attention:>17.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
