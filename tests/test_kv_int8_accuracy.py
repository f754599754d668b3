"""Accuracy of the int8 KV cache on the built-in model (bf16, as served): over a fixed prompt set (windows of
tests/data/kv_int8_text.md), each prompt prefilled in chunks that read the earlier ones back from the pool and its
last tokens fed one decode step at a time (teacher forcing), the mean next-token logprob of the text's real tokens
with int8 KV is within 0.02 nats of bfloat16 KV's.
scripts/kv_int8_accuracy.py measures the same at 1k-token contexts and prints greedy agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from waferscale import kernels
from waferscale.engine.kv_cache import KVPool, PagedBatch
from waferscale.engine.llm_engine import kv_cache_dtypes
from waferscale.models import load_model

TEXT = Path(__file__).parent / "data" / "kv_int8_text.md"
PROMPTS, LENGTH, CHUNK, DECODED, BS = 2, 224, 32, 8, 16


@pytest.fixture(scope="module")
def builtin():
    return load_model(None, dtype="bfloat16", progress=False)


def _next_token_logprobs(loaded, ids: list[int], kv_cache_dtype: str, native) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprob of each real token after the first chunk, and the top token at each of those positions: the
    prompt prefilled in chunks of CHUNK (each reading the chunks before it from the pool), its last DECODED tokens
    fed one decode step at a time."""
    cfg, model = loaded.config, loaded.model
    dtype, compute = kv_cache_dtypes(kv_cache_dtype, loaded.dtype)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, len(ids) // BS + 2, BS, compute_dtype=compute)
    rows = []
    prefilled = len(ids) - DECODED
    for start in range(0, prefilled, CHUNK):
        end = min(start + CHUNK, prefilled)
        table = torch.arange(1, 1 + -(-end // BS))
        batch = PagedBatch(pool, torch.arange(start, end) + BS, prefills=[(0, end - start, table, start, end)])
        rows.append(model.logits(model(torch.tensor(ids[start:end]), torch.arange(start, end), batch)))
    for i in range(prefilled, len(ids) - 1):
        table = torch.arange(1, 1 + -(-(i + 1) // BS)).unsqueeze(0)
        batch = PagedBatch(
            pool, torch.tensor([i + BS]), num_decode=1, decode_tables=table, decode_lengths=torch.tensor([i + 1]),
            native=native,
        )  # fmt: skip
        rows.append(model.logits(model(torch.tensor([ids[i]]), torch.tensor([i]), batch)))
    lp = torch.log_softmax(torch.cat(rows)[CHUNK - 1 :].float(), dim=-1)  # positions predicting tokens CHUNK..
    return lp.gather(1, torch.tensor(ids[CHUNK:])[:, None]).squeeze(1), lp.argmax(-1)


def test_int8_kv_mean_next_token_logprob_is_within_0_02_nats_of_bf16_kv(builtin):
    native = kernels.load()  # None where they cannot be built: the PyTorch path, as the server would run
    ids = builtin.tokenizer.encode(TEXT.read_text())
    step = (len(ids) - LENGTH) // (PROMPTS - 1)
    prompts = [ids[i * step : i * step + LENGTH] for i in range(PROMPTS)]
    scored = {
        kv: [_next_token_logprobs(builtin, p, kv, native) for p in prompts] for kv in ("bfloat16", "int8")
    }
    bf16, int8 = (torch.cat([lp for lp, _ in scored[kv]]) for kv in ("bfloat16", "int8"))
    assert bf16.numel() == PROMPTS * (LENGTH - CHUNK)
    assert abs(int8.mean() - bf16.mean()) < 0.02
    assert (int8 - bf16).abs().mean() < 0.1  # no token far off either, whatever the signs
    agree = torch.cat([a == b for (_, a), (_, b) in zip(scored["bfloat16"], scored["int8"])]).float().mean()
    assert agree >= 0.8
