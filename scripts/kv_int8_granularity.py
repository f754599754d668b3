"""Which int8 KV scale granularity: the rounding error of real keys and values under a scale per token and head, per
token, head and 64 channels (what --kv-cache-dtype int8 stores), and per block of 16 tokens and head, and the bytes
each costs.

Usage: .venv/bin/python scripts/kv_int8_granularity.py [--model PATH] [--context 1024]

A context of repository prose is prefilled into a float32 pool; each layer's keys (after rope) and values are then
rounded offline both ways, and the script prints, for keys and values, the relative RMS error (over all layers)
and the bytes a token takes with each scheme relative to bf16.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from waferscale.engine import kv_int8
from waferscale.engine.kv_cache import KVPool, prefill_batch
from waferscale.models import load_model

ROOT = Path(__file__).resolve().parent.parent
BS = 16


def _round(groups: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 rounding with one scale per last-dimension vector, back to float32."""
    scale = groups.abs().amax(-1, keepdim=True) / 127
    return torch.round(groups / torch.where(scale > 0, scale, torch.ones_like(scale))) * scale


def per_head(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D] rounded with one scale per token and head."""
    return _round(x)


def per_64(x: torch.Tensor) -> torch.Tensor:
    """One scale per token, head and 64 channels: what --kv-cache-dtype int8 stores (engine/kv_int8)."""
    return kv_int8.dequantize(*kv_int8.quantize(x))


def per_block(x: torch.Tensor) -> torch.Tensor:
    """One scale per block of BS tokens and head."""
    t, h, d = x.shape
    blocks = x.view(t // BS, BS, h, d).transpose(1, 2).reshape(t // BS, h, BS * d)
    return _round(blocks).view(t // BS, h, BS, d).transpose(1, 2).reshape(t, h, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file or folder (default: the built-in model)")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="float32", progress=False)
    cfg = loaded.config
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    n = args.context // BS * BS
    ids = loaded.tokenizer.encode(text)[:n]
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, n // BS + 2, BS)
    loaded.model(torch.tensor(ids), torch.arange(n), prefill_batch(pool, n))
    print(f"model: {loaded.name}; {n} tokens of context; {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of "
          f"{cfg.head_dim}")
    d = cfg.head_dim
    schemes = {
        "per token and head": (per_head, (d + 4) / (2 * d)),
        "per token, head, 64 ch.": (per_64, (d + 4 * kv_int8.num_scales(d)) / (2 * d)),
        "per block of 16 and head": (per_block, (d + 4 / BS) / (2 * d)),
    }
    print(f"{'scale':<26} {'keys rel. RMS err':>18} {'values rel. RMS err':>20} {'bytes vs bf16':>14}")
    for name, (fn, size) in schemes.items():
        errs = []
        for cache in (pool.k, pool.v):
            num = den = 0.0
            for layer in range(cfg.num_layers):
                x = cache[layer, BS : BS + n]
                num += (fn(x) - x).pow(2).sum().item()
                den += x.pow(2).sum().item()
            errs.append((num / den) ** 0.5)
        print(f"{name:<26} {errs[0]:>18.4%} {errs[1]:>20.4%} {size:>13.3f}x")


if __name__ == "__main__":
    main()
