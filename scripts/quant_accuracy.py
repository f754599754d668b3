"""Accuracy of quantized weights against float32, on the built-in SmolLM2-135M-Instruct (or --model).

Usage: .venv/bin/python scripts/quant_accuracy.py [--model PATH] [--tokens 32] [--prompts 8]
                                                  [--activations float32,auto] [--stepwise]

The reference is today's exact path: the model's weights dequantized to float32, float32 activations. For each
fixed prompt, the reference's greedy continuation is fed to every variant (teacher forcing, one forward each), and
the script prints, per variant: greedy agreement (share of positions where the variant's top token is the
reference's), the mean difference of the next-token log-probability of the reference's token (the issue's bar:
Q8_0/int8 within 0.02 nats of float32 in mean next-token logprob) and its mean absolute difference (a stricter
reading: every token's error counts, whatever its sign), the mean KL divergence, and perplexity on a fixed text.

Variants: the GGUF's own blocks (Q4_1 and Q8_0 for the built-in model) served by the integer kernels; int8 and int4
quantized from the float32 weights; each with float32 and with bfloat16 activations (the server's default).
--activations names the kernels' activation modes to measure the GGUF blocks with (quant.ACTIVATION_MODES; default:
the server's, auto). --stepwise runs the variants one token a forward, so that every product has one row, as
decoding multiplies them (auto's int8 activations for the K-quants apply only there; a whole-sequence forward
takes the float32 panels); the reference stays one forward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from waferscale.engine.kv_cache import KVPool, PagedBatch, prefill_batch
from waferscale.models import builtin_model_path, load_model
from waferscale.models.loader import _converted_gguf
from waferscale.models.quant import modules as quant  # QuantLinear's module: ACT_MODE set here reaches it

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which",
]
# a fixed text for perplexity (the opening of the Wikipedia article on the Moon, CC BY-SA)
TEXT = (
    "The Moon is Earth's only natural satellite. It orbits around Earth at an average distance of 384,399 "
    "kilometres, about 30 times Earth's diameter. The Moon always presents the same side to Earth, because "
    "gravitational pull has locked its rotation to the planet. This results in the lunar day of 29.5 days "
    "matching the lunar month. The Moon's gravitational pull, and to a lesser extent the Sun's, are the main "
    "drivers of Earth's tides. In geophysical terms, the Moon is a planetary-mass object or satellite planet. "
    "Its mass is 1.2% that of the Earth, and its diameter is 3,474 km, roughly one-quarter of Earth's."
)


def logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """float32 log-softmax of the next-token logits at every position of ids (one prefill forward)."""
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, len(ids) // 16 + 2, 16)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), prefill_batch(pool, len(ids)))
    return torch.log_softmax(loaded.model.logits(hidden).float(), dim=-1)


def logprobs_stepwise(loaded, ids: list[int]) -> torch.Tensor:
    """As logprobs, but one token a forward (each a one-token chunk of the prompt): decode-sized products."""
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, len(ids) // 16 + 2, 16)
    table = torch.arange(1, 1 + -(-len(ids) // pool.block_size))
    rows = []
    for i, tok in enumerate(ids):
        batch = PagedBatch(pool, torch.tensor([i + pool.block_size]), prefills=[(0, 1, table, i, i + 1)])
        hidden = loaded.model(torch.tensor([tok]), torch.tensor([i]), batch)
        rows.append(torch.log_softmax(loaded.model.logits(hidden).float(), dim=-1))
    return torch.cat(rows)


def greedy_continuation(loaded, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(logprobs(loaded, out)[-1].argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the built-in model)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--activations", default="auto", help="activation modes for the GGUF blocks: float32,int8,auto")
    ap.add_argument("--stepwise", action="store_true", help="variants one token a forward (decode-sized products)")
    args = ap.parse_args()
    modes = args.activations.split(",")
    default_mode = quant.ACT_MODE
    src = args.model or builtin_model_path()
    ref = load_model(src, dtype="float32", progress=False)
    assert ref.quantization == "none"
    float_folder = _converted_gguf(src, "float32", progress=False)  # the dequantized weights, as a folder
    variants = {}  # name: (model, activation mode)
    for dtype in ("float32", "bfloat16"):
        blocks = load_model(src, dtype=dtype, quantization="int8", progress=False)
        for mode in modes:
            variants[f"GGUF blocks, {dtype}, {mode} activations"] = (blocks, quant.ACTIVATION_MODES[mode])
        for method in ("int8", "int4"):
            variants[f"{method} (g32), {dtype}"] = (
                load_model(float_folder, dtype=dtype, quantization=method, progress=False),
                default_mode,
            )
    prompts = PROMPTS[: args.prompts]
    sequences = [greedy_continuation(ref, ref.tokenizer.encode(p), args.tokens) for p in prompts]
    starts = [len(ref.tokenizer.encode(p)) for p in prompts]
    text_ids = ref.tokenizer.encode(TEXT)
    ref_lp = [logprobs(ref, s) for s in sequences]
    ref_text = logprobs(ref, text_ids)

    def ppl(lp: torch.Tensor) -> float:
        return float(torch.exp(-lp[:-1].gather(1, torch.tensor(text_ids[1:])[:, None]).mean()))

    print(
        f"model: {src.name}; {len(prompts)} prompts x {args.tokens} greedy tokens of the float32 reference; "
        f"perplexity over {len(text_ids)} tokens; variants {'one token a forward' if args.stepwise else 'one forward'}"
    )
    forward = logprobs_stepwise if args.stepwise else logprobs
    print(f"float32 reference perplexity: {ppl(ref_text):.3f}\n")
    print(
        "| variant | greedy agreement | mean logprob diff (nats) | mean abs logprob diff (nats) | mean KL (nats) "
        "| perplexity |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, (loaded, mode) in variants.items():
        quant.ACT_MODE = mode  # QuantLinear reads it at each call
        agree, diffs, kls = [], [], []
        for seq, start, rlp in zip(sequences, starts, ref_lp):
            lp = forward(loaded, seq)
            pos = slice(start - 1, len(seq) - 1)
            targets = torch.tensor(seq[start:])[:, None]
            agree.append((lp[pos].argmax(-1) == rlp[pos].argmax(-1)).float())
            diffs.append((lp[pos].gather(1, targets) - rlp[pos].gather(1, targets)).squeeze(1))
            kls.append((rlp[pos].exp() * (rlp[pos] - lp[pos])).sum(-1))
        a, k = (torch.cat(x).mean().item() for x in (agree, kls))
        d = torch.cat(diffs)
        print(
            f"| {name} | {a:.1%} | {d.mean().item():+.4f} | {d.abs().mean().item():.4f} | {k:.4f} "
            f"| {ppl(forward(loaded, text_ids)):.3f} |"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
