"""Single-stream decode of a random gpt-oss-20b-shaped model (MXFP4 experts, as the released checkpoint stores
them) through the engine, beside its active-bytes bound: the bytes a decoded token reads (attention, router, the
active experts' MXFP4 blocks, norms and the head) over the bandwidth a streaming read gets here.

    PYTHONPATH=src python scripts/bench_gpt_oss.py --layers 2 [--threads 2] [--tokens 32] [--prompt 64] [--dir DIR]

The model is written once by ../shared/bench/make_random_model.py --preset gpt-oss-20b --layers N (into --dir, or
a temporary folder), with the built-in model's tokenizer (so the vocabulary, and the head, is SmolLM2's 49152, not
gpt-oss's 201088). Prints tokens/s, the bound, their ratio and the peak RSS. Figures depend on the machine's load:
run it on a quiet machine, and say N beside every figure.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MAKER = ROOT.parent / "shared" / "bench" / "make_random_model.py"


def bandwidth_probe() -> float:
    """GB/s of torch's sum over a 1 GB float32 tensor (all threads): what streaming memory gives here."""
    big = torch.ones(1 << 28)
    big.sum()
    t0 = time.perf_counter()
    big.sum()
    return big.numel() * 4 / (time.perf_counter() - t0) / 1e9


def tokenizer_json() -> Path:
    """The built-in model's tokenizer.json (from its converted folder in the cache, made once)."""
    from waferscale.models import builtin_model_path
    from waferscale.models.loader import _converted_gguf

    return _converted_gguf(builtin_model_path(), "bfloat16", progress=False) / "tokenizer.json"


def make_model(out: Path, layers: int, maker: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    cmd = [sys.executable, str(maker), "--preset", "gpt-oss-20b", "--layers", str(layers),
           "--tokenizer", str(tokenizer_json()), str(out)]
    subprocess.run(cmd, check=True)
    return out


def active_bytes(model) -> int:
    """Bytes one decoded token reads: every layer's attention, norms and router, its k active experts' blocks
    (an average expert's: they are the same size), the final norm and the head."""
    cfg = model.config
    total = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        total += sum(_linear_bytes(p) for p in (attn.qkv_proj, attn.o_proj, layer.mlp.gate))
        expert = layer.mlp.experts[0]
        per_expert = sum(_linear_bytes(p) for p in (expert.gate_up_proj, expert.down_proj))
        total += cfg.num_experts_per_tok * per_expert + 2 * cfg.hidden_size * 2  # and the layer's two norms
    return total + _linear_bytes(model.model.lm_head) + cfg.hidden_size * 2


def _linear_bytes(proj) -> int:
    """A projection's weight and bias bytes as loaded (MXFP4 blocks and scales, or the float weight)."""
    weight = proj.quant.nbytes() if proj.quant is not None else proj.weight.numel() * proj.weight.element_size()
    bias = proj.quant.bias if proj.quant is not None else proj.bias
    return weight + (0 if bias is None else bias.numel() * bias.element_size())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="of the preset's 24")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--dir", type=Path, help="where the model is written (reused when it exists)")
    ap.add_argument("--maker", type=Path, default=MAKER, help="make_random_model.py")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from waferscale.engine import LLMEngine, SamplingParams
    from waferscale.models import load_model

    folder = args.dir or Path(tempfile.mkdtemp(prefix="gpt-oss-20b-"))
    make_model(folder, args.layers, args.maker)
    t0 = time.perf_counter()
    loaded = load_model(folder, dtype="bfloat16", max_model_len=4096, progress=False)
    load_s = time.perf_counter() - t0
    engine = LLMEngine(loaded, enable_prefix_cache=False)
    ids = torch.randint(100, 40000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(max_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for the rest)."""
        engine.add_request("b", ids, SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0))
        t = time.perf_counter()
        first = None
        while engine.has_work():
            for ev in engine.step():
                if ev.token_ids and first is None:
                    first = time.perf_counter()
        return first - t, time.perf_counter() - first

    run(4)  # warm-up
    _, decode_s = run(args.tokens + 1)
    rate = args.tokens / decode_s
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # before the probe's 1 GB
    need = active_bytes(loaded)
    bandwidth = bandwidth_probe()
    bound = bandwidth * 1e9 / need
    print(f"gpt-oss-20b shape, {args.layers} of 24 layers, MXFP4 experts, bf16, {args.threads} threads")
    print(f"load {load_s:.1f} s; peak RSS {rss:.2f} GiB")
    print(f"single stream: {rate:.2f} tokens/s over {args.tokens} tokens after a {args.prompt}-token prompt")
    print(f"active bytes a token {need / 1e6:.1f} MB; streaming read {bandwidth:.1f} GB/s; bound {bound:.1f} tokens/s;"
          f" {100 * rate / bound:.0f}% of it")


if __name__ == "__main__":
    main()
