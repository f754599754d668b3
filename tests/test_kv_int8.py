"""The int8 KV cache's attention: the native kernels and the PyTorch fallback read an int8 pool as the same
attention over its dequantized values (decode rows and a prefill chunk, with a sliding window and sink logits),
a fused decode stores the very bytes the PyTorch path stores, and the pool counts its scales. A bf16 pool read in
float32 (CPUs without bf16 arithmetic) is attention over its stored values.

Accuracy on the built-in model (bf16): over a fixed prompt set (windows of tests/data/kv_int8_text.md), each prompt
prefilled in chunks that read the earlier ones back from the pool and its last tokens fed one decode step at a time
(teacher forcing), the mean next-token logprob of the text's real tokens with int8 KV is within 0.02 nats of
bfloat16 KV's. scripts/kv_int8_accuracy.py measures the same at 1k-token contexts and prints greedy agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from waferscale import kernels
from waferscale.engine import kv_cache, kv_int8
from waferscale.engine.kv_cache import KVGroup, KVPool, PagedBatch
from waferscale.engine.llm_engine import kv_cache_dtypes
from waferscale.models import load_model
from waferscale.models.layers.attention import paged_attention

native = kernels.load()
needs_native = pytest.mark.skipif(native is None, reason="native kernels unavailable")

H, KVH, BS = 6, 2, 16
TEXT = Path(__file__).parent / "data" / "kv_int8_text.md"
PROMPTS, LENGTH, CHUNK, DECODED = 2, 192, 32, 8
# two decode rows (lengths 40 and 75) and a prefill chunk of positions 20..49 of a third sequence
DECODE_LENGTHS = [40, 75]
TABLES = [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
PREFILL_TABLE, PREFILL_START, PREFILL_END = [9, 10, 11, 12], 20, 50


def _slots(table: list[int], positions: range) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in positions])


def _history(pool: KVPool, seed: int = 0) -> None:
    """Keys and values of every position before this step's rows, written as the engine writes them."""
    g = torch.Generator().manual_seed(seed)
    cache = pool.layer_kv(0)
    d = pool.k.shape[-1]
    for table, n in [*zip(TABLES, [n - 1 for n in DECODE_LENGTHS]), (PREFILL_TABLE, PREFILL_START)]:
        slots = _slots(table, range(n))
        cache.write(slots, torch.randn(n, KVH, d, generator=g), torch.randn(n, KVH, d, generator=g) * 3)


def _plan(pool: KVPool, use_native: bool) -> PagedBatch:
    slots = torch.cat(
        [_slots(t, range(n - 1, n)) for t, n in zip(TABLES, DECODE_LENGTHS)]
        + [_slots(PREFILL_TABLE, range(PREFILL_START, PREFILL_END))]
    )
    rows = len(DECODE_LENGTHS)
    prefill = (rows, rows + PREFILL_END - PREFILL_START, torch.tensor(PREFILL_TABLE), PREFILL_START, PREFILL_END, 0)
    group = KVGroup(slots, torch.tensor(TABLES), torch.tensor(DECODE_LENGTHS), prefills=[prefill])
    return PagedBatch(pool, num_decode=rows, native=native if use_native else None, groups=[group])


def _step(d: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    rows = len(DECODE_LENGTHS) + PREFILL_END - PREFILL_START
    return torch.randn(rows, H, d, generator=g), torch.randn(rows, KVH, d, generator=g), torch.randn(
        rows, KVH, d, generator=g
    )


def _pool(dtype, d: int) -> KVPool:
    return KVPool(1, KVH, d, dtype, 13, BS, compute_dtype=torch.float32)


@needs_native
@pytest.mark.parametrize("window,sinks", [(None, False), (24, False), (None, True), (24, True)])
@pytest.mark.parametrize("d", [32, 128])  # one scale a head; two (64 channels each)
def test_native_and_pytorch_read_int8_as_attention_over_the_dequantized_values(window, sinks, d):
    q, k, v = _step(d)
    sink = torch.randn(H) if sinks else None
    outs = {}
    for name, use_native in (("native", True), ("pytorch", False)):
        pool = _pool(torch.int8, d)
        _history(pool)
        outs[name] = paged_attention(_plan(pool, use_native), 0, q, k, v, d**-0.5, window, sink)
    # the reference: a float32 pool holding exactly the int8 pool's values after the step
    ref_pool = _pool(torch.float32, d)
    ref_pool.k[0] = kv_int8.dequantize(pool.k[0], pool.k_scale[0])
    ref_pool.v[0] = kv_int8.dequantize(pool.v[0], pool.v_scale[0])
    deq = [kv_int8.dequantize(*kv_int8.quantize(x)) for x in (k, v)]
    want = paged_attention(_plan(ref_pool, False), 0, q, *deq, d**-0.5, window, sink)
    torch.testing.assert_close(outs["native"], want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(outs["pytorch"], want, atol=2e-5, rtol=1e-5)
    # and the unquantized values give nearly, not exactly, the same attention
    exact = _pool(torch.float32, d)
    _history(exact)
    diff = (paged_attention(_plan(exact, False), 0, q, k, v, d**-0.5, window, sink) - want).abs().max().item()
    assert 1e-4 < diff < 0.1


@needs_native
@pytest.mark.parametrize("window,sinks", [(None, False), (24, True)])
def test_a_bf16_pool_read_in_float32_is_attention_over_the_rounded_values(window, sinks):
    """As CPUs without bf16 arithmetic serve it (kv_cache_dtypes' auto there): the pool stores bf16, and the native
    kernels and the PyTorch path compute in float32 over exactly the stored values."""
    d = 64
    q, k, v = _step(d)
    sink = torch.randn(H) if sinks else None
    outs = {}
    for name, use_native in (("native", True), ("pytorch", False)):
        pool = _pool(torch.bfloat16, d)
        assert pool.layer_kv(0).compute_dtype == torch.float32
        _history(pool)
        outs[name] = paged_attention(_plan(pool, use_native), 0, q, k, v, d**-0.5, window, sink)
        assert outs[name].dtype == torch.float32
    ref_pool = _pool(torch.float32, d)
    ref_pool.k[0], ref_pool.v[0] = pool.k[0].float(), pool.v[0].float()
    rounded = [x.bfloat16().float() for x in (k, v)]
    want = paged_attention(_plan(ref_pool, False), 0, q, *rounded, d**-0.5, window, sink)
    torch.testing.assert_close(outs["native"], want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(outs["pytorch"], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "native_bf16,kv,want",
    [
        (True, "auto", (torch.bfloat16, torch.bfloat16)),
        (False, "auto", (torch.bfloat16, torch.float32)),  # half the bytes of a float32 pool, read as float32
        (False, "bfloat16", (torch.bfloat16, torch.float32)),
        (False, "int8", (torch.int8, torch.float32)),
        (True, "float32", (torch.float32, torch.float32)),
    ],
)
def test_the_pool_keeps_the_models_dtype_and_computes_in_float32_without_bf16_arithmetic(
    monkeypatch, native_bf16, kv, want
):
    monkeypatch.setattr(kv_cache, "cpu_has_native_bf16", lambda: native_bf16)
    assert kv_cache_dtypes(kv, torch.bfloat16) == want
    assert kv_cache_dtypes("auto", torch.float32) == (torch.float32, torch.float32)


def test_an_int8_pool_counts_its_scales_and_holds_about_twice_the_tokens_of_bfloat16():
    args = (30, 3, 64)  # the built-in model's layers, KV heads and head size
    int8 = KVPool.bytes_per_block(*args, torch.int8, BS)
    bf16 = KVPool.bytes_per_block(*args, torch.bfloat16, BS)
    assert int8 == 2 * 30 * BS * 3 * (64 + 4)
    assert 1.85 < bf16 / int8 < 2
    pool = KVPool(*args, torch.int8, 5, BS)
    assert pool.nbytes == 5 * int8 and pool.k_scale.dtype == torch.float32
    # Gemma 3 270M's heads of 256: four scales a token and head, the same share of the bytes
    assert KVPool.bytes_per_block(18, 1, 256, torch.int8, BS) == 2 * 18 * BS * (256 + 16)


@needs_native
def test_the_native_write_rounds_each_64_channels_of_a_wide_head_as_pytorch_does():
    """decode_attention_bf16 on heads of 128 (rope an identity here: cos 1, sin 0) stores kv_int8.quantize's bytes
    and scales, and attends as the PyTorch path over the same pool."""
    torch.manual_seed(2)
    d, rows = 128, 2
    pool = KVPool(1, KVH, d, torch.int8, 13, BS, compute_dtype=torch.float32)
    _history(pool)
    qkv = torch.randn(rows, (H + 2 * KVH) * d).bfloat16()
    qkv[:, (H + 1) * d + 5] = 40.0  # an outlier in channel 5 of the second key head
    slots = torch.cat([_slots(t, range(n - 1, n)) for t, n in zip(TABLES, DECODE_LENGTHS)])
    tables, lengths = torch.tensor(TABLES), torch.tensor(DECODE_LENGTHS)
    c = pool.layer_kv(0)
    out = native.decode_attention_bf16(
        qkv, torch.ones(rows, d).bfloat16(), torch.zeros(rows, d).bfloat16(), c.k, c.v, slots, tables, lengths, H,
        d**-0.5, BS, k_scale=c.k_scale, v_scale=c.v_scale,
    )  # fmt: skip
    k = qkv[:, H * d : (H + KVH) * d].view(rows, KVH, d)
    v = qkv[:, (H + KVH) * d :].view(rows, KVH, d)
    for stored, scales, x in ((c.k, c.k_scale, k), (c.v, c.v_scale, v)):
        q, s = kv_int8.quantize(x)
        assert torch.equal(stored[slots], q) and torch.equal(scales[slots], s)
    assert c.k_scale[slots][0, 1, 0] > 10 * c.k_scale[slots][0, 1, 1]  # the outlier's group only
    plan = PagedBatch(pool, slots, num_decode=rows, decode_tables=tables, decode_lengths=lengths)
    want = paged_attention(plan, 0, qkv[:, : H * d].view(rows, H, d).float(), k, v, d**-0.5)
    torch.testing.assert_close(out.float().view(rows, H, d), want, atol=1e-2, rtol=2**-7)


@pytest.fixture(scope="module")
def builtin_bf16():
    return load_model(None, dtype="bfloat16", quantization="none", progress=False)


@needs_native
def test_fused_decode_stores_the_bytes_the_pytorch_path_stores(builtin_bf16):
    """A decode-only batch quantizes its new keys and values in the native call: the same int8 values and scales as
    kv_int8.quantize in the PyTorch path, and an attention output as close as bf16 allows."""
    cfg, model = builtin_bf16.config, builtin_bf16.model
    attn = model.layers[3].self_attn
    lengths = torch.tensor([1, 16, 17, 90])
    width = int(-(-lengths.max() // BS))
    tables = torch.arange(1, 1 + len(lengths) * width).view(len(lengths), width)
    last = lengths - 1
    slots = tables[torch.arange(len(lengths)), last // BS] * BS + last % BS
    torch.manual_seed(4)
    x = torch.randn(len(lengths), cfg.hidden_size).bfloat16()
    rope = model.rotary(last)
    results = []
    for fused in (True, False):
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.int8, 1 + tables.numel(), BS)
        torch.manual_seed(5)  # the same earlier keys and values in both pools
        pool.k.random_(-127, 128)
        pool.v.random_(-127, 128)
        pool.k_scale.uniform_(0.001, 0.03)
        pool.v_scale.uniform_(0.001, 0.03)
        batch = PagedBatch(pool, slots, num_decode=len(lengths), decode_tables=tables, decode_lengths=lengths)
        batch.native = native if fused else None
        assert batch.can_fuse_decode(len(lengths), cfg.head_dim) is fused
        out = attn(x, rope, batch, 3)
        results.append((out, *(t[3][slots].clone() for t in (pool.k, pool.v, pool.k_scale, pool.v_scale))))
    (out_f, *stored_f), (out_t, *stored_t) = results
    for a, b in zip(stored_f, stored_t):
        assert torch.equal(a, b)
    assert stored_f[0].abs().amax(-1).eq(127).all()  # each head's largest value lands on 127
    torch.testing.assert_close(out_f.float(), out_t.float(), atol=2e-2, rtol=2**-7)


@needs_native
def test_whole_layer_decode_with_int8_kv_matches_the_modules_bit_for_bit(builtin_bf16):
    """decode_layer (each layer one native call) and the layers' modules store and read an int8 pool alike."""
    cfg, model = builtin_bf16.config, builtin_bf16.model
    assert model.decode_layers is not None
    lengths = torch.tensor([1, 16, 17, 90])
    rows, width = len(lengths), int(-(-lengths.max() // BS))
    tables = torch.arange(1, 1 + rows * width).view(rows, width)
    last = lengths - 1
    slots = tables[torch.arange(rows), last // BS] * BS + last % BS
    ids = torch.tensor([42, 7, 1000, 31])
    results = []
    for whole in (True, False):
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.int8, 1 + tables.numel(), BS)
        torch.manual_seed(5)
        pool.k.random_(-127, 128)
        pool.v.random_(-127, 128)
        pool.k_scale.uniform_(0.001, 0.03)
        pool.v_scale.uniform_(0.001, 0.03)
        batch = PagedBatch(pool, slots, num_decode=rows, decode_tables=tables, decode_lengths=lengths, native=native)
        saved = model.decode_layers
        if not whole:
            model.decode_layers = None
        try:
            hidden = model(ids, last, batch)
        finally:
            model.decode_layers = saved
        results.append((hidden, pool.k[:, slots].clone(), pool.k_scale[:, slots].clone(), pool.v_scale[:, slots]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _next_token_logprobs(loaded, ids: list[int], kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprob of each real token after the first chunk, and the top token at each of those positions: the
    prompt prefilled in chunks of CHUNK (each reading the chunks before it from the pool), its last DECODED tokens
    fed one decode step at a time (through the native kernels where they could be built, as the server runs)."""
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


def test_int8_kv_mean_next_token_logprob_is_within_0_02_nats_of_bf16_kv(builtin_bf16):
    ids = builtin_bf16.tokenizer.encode(TEXT.read_text())
    step = (len(ids) - LENGTH) // (PROMPTS - 1)
    prompts = [ids[i * step : i * step + LENGTH] for i in range(PROMPTS)]
    scored = {
        kv: [_next_token_logprobs(builtin_bf16, p, kv) for p in prompts] for kv in ("bfloat16", "int8")
    }
    bf16, int8 = (torch.cat([lp for lp, _ in scored[kv]]) for kv in ("bfloat16", "int8"))
    assert bf16.numel() == PROMPTS * (LENGTH - CHUNK)
    assert abs(int8.mean() - bf16.mean()) < 0.02
    assert (int8 - bf16).abs().mean() < 0.1  # no token far off either, whatever the signs
    agree = torch.cat([a == b for (_, a), (_, b) in zip(scored["bfloat16"], scored["int8"])]).float().mean()
    assert agree >= 0.8
