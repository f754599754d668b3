"""Native CPU kernels: each matches the PyTorch ops it replaces, and everything runs without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from waferscale import kernels
from waferscale.engine import LLMEngine, SamplingParams, kv_int8
from waferscale.models import load_model

native = kernels.load()
needs_native = pytest.mark.skipif(
    native is None, reason="native kernels could not be built here (no C compiler)"
)


def sdpa_over_gathered_blocks(q, k_cache, v_cache, tables, lengths, block_size, scale):
    """The reference: gather each sequence's blocks, mask positions past its length, scaled_dot_product_attention."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    keys = k_cache.view(-1, block_size, kvh, d)[tables].reshape(b, -1, kvh, d).transpose(1, 2).float()
    values = v_cache.view(-1, block_size, kvh, d)[tables].reshape(b, -1, kvh, d).transpose(1, 2).float()
    mask = (torch.arange(keys.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=h != kvh
    )
    return out.squeeze(2)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (32, 4, 128): Qwen3's 8 query heads a kv head of 128 channels, one vector of channels a pass on AVX2
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 64), (32, 4, 128)])
def test_paged_decode_attention_matches_sdpa(dtype, heads, kv_heads, d):
    torch.manual_seed(0)
    block_size, num_blocks = 16, 128
    lengths = torch.tensor([1, 15, 16, 17, 100, 250])
    width = int(-(-lengths.max() // block_size))
    # blocks scattered over the pool in no particular order; block 0 pads the short tables, as in the engine
    order = torch.randperm(num_blocks - 1)[: len(lengths) * width] + 1
    tables = order.view(len(lengths), width).clone()
    for i, n in enumerate(lengths.tolist()):
        tables[i, -(-n // block_size) :] = 0
    k_cache = torch.randn(num_blocks * block_size, kv_heads, d).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, d).to(dtype)
    q = torch.randn(len(lengths), heads, d)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lengths, d**-0.5, block_size)
    want = sdpa_over_gathered_blocks(q, k_cache, v_cache, tables, lengths, block_size, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def _long_pool(lengths: list[int], block_size: int = 16, kv_heads: int = 3, d: int = 64):
    """A pool holding sequences of these lengths in scattered blocks, and their tables."""
    width = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * width + 1
    order = torch.randperm(num_blocks - 1)[: len(lengths) * width] + 1
    tables = order.view(len(lengths), width).clone()
    k_cache = torch.randn(num_blocks * block_size, kv_heads, d)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, d)
    return tables, k_cache, v_cache


@needs_native
def test_paged_decode_attention_over_long_contexts_merges_its_chunks_exactly():
    """Sequences longer than one task's chunk (512 positions) are split and merged: the softmax of the whole, with
    sinks and a window start too."""
    torch.manual_seed(3)
    lengths = torch.tensor([1500, 4100, 1024, 1025, 30])
    tables, k_cache, v_cache = _long_pool(lengths.tolist())
    q = torch.randn(len(lengths), 9, 64)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 64**-0.5, 16)
    want = sdpa_over_gathered_blocks(q, k_cache, v_cache, tables, lengths, 16, 64**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    starts = torch.tensor([700, 0, 0, 1, 3])
    sinks = torch.randn(9)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 64**-0.5, 16, starts, sinks)
    keys = k_cache.view(-1, 16, 3, 64)[tables].reshape(len(lengths), -1, 3, 64).repeat_interleave(3, 2)
    values = v_cache.view(-1, 16, 3, 64)[tables].reshape(len(lengths), -1, 3, 64).repeat_interleave(3, 2)
    for b, (s0, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        scores = torch.einsum("hd,thd->ht", q[b], keys[b, s0:n]) * 64**-0.5
        logits = torch.cat([scores, sinks[:, None]], 1)
        p = logits.softmax(-1)[:, :-1]
        torch.testing.assert_close(got[b], torch.einsum("ht,thd->hd", p, values[b, s0:n]), atol=2e-6, rtol=1e-5)


@needs_native
def test_a_long_sequences_attention_does_not_depend_on_the_batch():
    torch.manual_seed(4)
    lengths = torch.tensor([3000, 2000, 50])
    tables, k_cache, v_cache = _long_pool(lengths.tolist())
    k8, ks = kv_int8.quantize(k_cache)
    v8, vs = kv_int8.quantize(v_cache)
    q = torch.randn(3, 9, 64)
    for k, v, scales in ((k_cache, v_cache, {}), (k8, v8, {"k_scale": ks, "v_scale": vs})):
        together = native.paged_decode_attention(q, k, v, tables, lengths, 0.125, 16, **scales)
        alone = native.paged_decode_attention(q[:1], k, v, tables[:1], lengths[:1], 0.125, 16, **scales)
        assert torch.equal(together[0], alone[0])


@needs_native
@pytest.mark.parametrize("first", [1020, 2050])
def test_the_rows_of_one_sequence_each_get_their_attention_alone_bit_for_bit(first):
    """A step verifying 8 drafts runs 9 rows over one sequence's blocks, lengths one apart (here across a chunk
    boundary of 512 positions, or within one): its chunks are worked row after row on one thread, and each row's
    numbers are those of the row alone, on bf16 and int8 caches."""
    torch.manual_seed(5)
    tables, k_cache, v_cache = _long_pool([first + 8])
    k8, ks = kv_int8.quantize(k_cache)
    v8, vs = kv_int8.quantize(v_cache)
    lengths = torch.arange(first, first + 9)
    q = torch.randn(9, 9, 64)
    for k, v, scales in ((k_cache.bfloat16(), v_cache.bfloat16(), {}), (k8, v8, {"k_scale": ks, "v_scale": vs})):
        rows = native.paged_decode_attention(q, k, v, tables.expand(9, -1).contiguous(), lengths, 0.125, 16, **scales)
        for r in range(9):
            alone = native.paged_decode_attention(q[r : r + 1], k, v, tables, lengths[r : r + 1], 0.125, 16, **scales)
            assert torch.equal(rows[r], alone[0])


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 50, 130])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 577, True), (20, 7, True)])
def test_linear_bf16_matches_float32_linear(rows, k, n, bias):
    """Packed bf16 weights widened exactly to float32: the float32 product, whatever M, K's size and N's tail."""
    torch.manual_seed(1)
    x = torch.randn(rows, k)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n) if bias else None
    got = native.linear_bf16(x, kernels.pack_bf16(w), n, b)
    torch.testing.assert_close(got, F.linear(x, w.float(), b), atol=2e-4, rtol=1e-5)


@needs_native
def test_linear_bf16_rows_do_not_depend_on_the_batch():
    """A row's result is bit-identical alone or among other rows, so batching never changes a bf16 sequence."""
    torch.manual_seed(6)
    x = torch.randn(40, 576).bfloat16()
    packed = kernels.pack_bf16(torch.randn(300, 576).bfloat16())
    whole = native.linear_bf16(x, packed, 300, None, torch.bfloat16)
    for start, stop in [(0, 1), (7, 8), (20, 22), (3, 10), (13, 40)]:
        assert torch.equal(
            native.linear_bf16(x[start:stop], packed, 300, None, torch.bfloat16), whole[start:stop]
        )


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 577, True), (20, 7, True)])
def test_linear_f32_matches_a_float64_product(rows, k, n, bias):
    """float32 weights read in place: the product within float32 rounding, whatever M, K's tail and N's tail."""
    torch.manual_seed(3)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    got = native.linear_f32(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@needs_native
def test_linear_f32_rows_do_not_depend_on_the_batch():
    """A float32 row's result is bit-identical alone or among other rows."""
    torch.manual_seed(7)
    x, w = torch.randn(16, 1539), torch.randn(301, 1539)
    whole = native.linear_f32(x, w)
    for start, stop in [(0, 1), (7, 8), (3, 6), (5, 16)]:
        assert torch.equal(native.linear_f32(x[start:stop], w), whole[start:stop])


@needs_native
def test_linear_bf16_takes_and_gives_bfloat16_rounded_like_torch():
    """bf16 in, bf16 out: the float32 product rounded to nearest even, as torch's .to(torch.bfloat16) rounds."""
    torch.manual_seed(2)
    x = torch.randn(3, 576).bfloat16()
    w = torch.randn(960, 576).bfloat16()
    b = torch.randn(960)
    packed = kernels.pack_bf16(w)
    got = native.linear_bf16(x, packed, 960, b, torch.bfloat16)
    want = native.linear_bf16(x.float(), packed, 960, b).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b), atol=0.1, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rmsnorm_bf16_matches_hugging_face_rmsnorm(rows):
    """LlamaRMSNorm in bf16: statistics in float32, normalised rows rounded to bf16, times the bf16 weight."""
    torch.manual_seed(3)
    x = (torch.randn(rows, 576) * 3).bfloat16()
    w = (torch.rand(576) + 0.5).bfloat16()
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = native.rmsnorm_bf16(x, w, 1e-5)
    # float32 sums in another order may move the normalised value across a bf16 rounding boundary: one step
    # there, at most two after the product with the weight
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-6)
    assert (got != want).float().mean() < 0.01


@needs_native
def test_argmax_logsumexp_matches_torch_on_logits():
    torch.manual_seed(0)
    logits = torch.randn(33, 49152) * 8
    logits[3, 100] = logits[3, 7] = logits[3].max() + 1  # a tie goes to the lowest id
    idx, lse = native.argmax_logsumexp(logits)
    assert idx == torch.argmax(logits, -1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1, keepdim=True), atol=0, rtol=2e-6)


@needs_native
def test_argmax_logsumexp_keeps_torchs_special_values():
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor(
        [
            [-inf, -inf, -inf, -inf],  # everything masked: -inf, argmax 0
            [1.0, 3.0, 3.0, -inf],
            [0.0, nan, 5.0, 1.0],  # NaN poisons the row
            [1.0, inf, 2.0, inf],
            [-0.0, 0.0, -1.0, -2.0],
        ]
    )
    idx, lse = native.argmax_logsumexp(rows)
    assert idx == torch.argmax(rows, -1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(rows, -1, keepdim=True), equal_nan=True)


@needs_native
def test_argmax_logsumexp_of_a_grammar_masked_row_matches_torch():
    """Rows mostly -inf (a grammar mask applied): the same logsumexp (the clamp keeps expf off its slow path)."""
    torch.manual_seed(0)
    logits = (torch.randn(4, 49152) * 8).masked_fill(torch.rand(4, 49152) < 0.9, float("-inf"))
    idx, lse = native.argmax_logsumexp(logits)
    assert idx == torch.argmax(logits, -1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1, keepdim=True), atol=0, rtol=2e-6)


def _unpacked(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab]


@needs_native
@pytest.mark.parametrize("vocab", [49152, 49155])  # a last word only partly in the vocabulary
def test_masked_argmax_is_torchs_argmax_over_the_allowed_tokens(vocab):
    torch.manual_seed(1)
    words = (vocab + 31) // 32
    logits = torch.randn(6, vocab) * 8
    bits = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32)  # mixed words
    bits[1] = -1  # everything allowed: whole words
    bits[2] = 0
    bits[2, 7] = 0b1001  # two tokens
    bits[3] = 0
    bits[3, -1] = -1  # the last word only: bits past the vocabulary are ignored
    logits[4, 64] = logits[4, 96] = logits[4].max() + 1  # a tie goes to the lowest id
    bits[4, 2] = bits[4, 3] = -1
    logits[5] = float("-inf")  # allowed tokens, all at -inf
    want = torch.argmax(logits.masked_fill(~_unpacked(bits, vocab), float("-inf")), -1).tolist()
    got = native.masked_argmax(logits, bits)
    assert got[:5] == want[:5]
    assert got[5] == -1


@needs_native
def test_masked_argmax_says_when_the_mask_allows_nothing():
    assert native.masked_argmax(torch.randn(2, 100), torch.zeros(2, 4, dtype=torch.int32)) == [-1, -1]


def test_engine_without_native_kernels_gives_the_same_greedy_tokens():
    """WAFERSCALE_NATIVE_KERNELS=0 turns the kernels off; the PyTorch path decodes the same greedy tokens.

    In float32, where only the attention kernel is used: in bfloat16 the rounding of a normalised row can differ by a
    step, and then the greedy pick of a bf16 tie (the same logit for two tokens) can go either way, as it does
    between transformers and any other engine."""
    script = (
        "import json, sys\n"
        "from waferscale import kernels\n"
        "from waferscale.engine import LLMEngine, SamplingParams\n"
        "from waferscale.models import load_model\n"
        "loaded = load_model(None, dtype='float32', progress=False)\n"
        "engine = LLMEngine(loaded)\n"
        "for i in range(2):\n"
        "    ids = loaded.tokenizer.encode('Tell me about the sea, part %d.' % i)\n"
        "    engine.add_request(str(i), ids, SamplingParams(max_tokens=16, min_tokens=16, temperature=0))\n"
        "out = {}\n"
        "while engine.has_work():\n"
        "    for ev in engine.step():\n"
        "        out.setdefault(ev.request_id, []).extend(ev.token_ids)\n"
        "print(json.dumps({'native': kernels.load() is not None, 'out': out}))\n"
    )

    def run(flag: str) -> dict:
        env = {**os.environ, "WAFERSCALE_NATIVE_KERNELS": flag}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    off = run("0")
    assert off["native"] is False
    on = run("1")
    assert on["native"] is (native is not None)
    assert on["out"] == off["out"]
    assert all(len(v) == 16 for v in off["out"].values())


@needs_native
def test_bf16_projections_use_the_packed_kernel_instead_of_float32_copies():
    """Where bf16 is emulated, or multiplied on AMX tiles by the native kernels, every projection reads its packed
    bf16 weight, one row or many; no float32 or row-major copy. Where it is multiplied in hardware without the
    tiles, batches of up to HARDWARE_BF16_NATIVE_ROWS rows do (decoding a few streams), and larger ones (here the
    prefill of 5 prompts) go to PyTorch's oneDNN. The MLP's gate/up runs with its SiLU-and-multiply, and o_proj and
    down_proj with their residual adds."""
    from waferscale.kernels import cpu_has_native_bf16
    from waferscale.models.layers.linear import HARDWARE_BF16_NATIVE_ROWS, PackedBF16Method, Unpacked

    loaded = load_model(None, dtype="bfloat16", quantization="none", progress=False)  # bf16 weights
    copies = cpu_has_native_bf16() and not native.bf16_tiles()  # a row-major copy for oneDNN's large batches
    mlp = loaded.model.layers[0].mlp
    assert isinstance(mlp.down_proj.method, PackedBF16Method)  # not a float32 copy
    assert mlp.gate_up_pairs is not None  # packed once, in pairs
    assert isinstance(mlp.gate_up_proj.method, Unpacked) != copies  # oneDNN's large batches need it
    limit = HARDWARE_BF16_NATIVE_ROWS if copies else None
    assert mlp.pair_rows == limit and mlp.down_proj.method.max_rows == limit
    engine = LLMEngine(loaded)
    assert engine.native is native
    engine.runner.rows_upto = 0  # the prompts through the prefill path's projections, not as decode rows
    for i in range(5):
        engine.add_request(
            str(i),
            loaded.tokenizer.encode(f"Hello {i}, tell me a story about a cat, a dog and a bird"),
            SamplingParams(max_tokens=3, min_tokens=3, temperature=0),
        )
    names = ("linear_bf16", "linear_silu_mul_bf16", "linear_add_bf16", "decode_layers_bf16")
    calls: dict[str, list[int]] = {name: [] for name in names}

    def counted(name):
        original = getattr(native, name)
        return lambda *a, **kw: calls[name].append(a[0].shape[0]) or original(*a, **kw)

    for name in calls:
        setattr(native, name, counted(name))
    try:
        while engine.has_work():
            engine.step()
    finally:
        for name in calls:
            delattr(native, name)
    layers, steps = loaded.config.num_layers, 3
    # the prefill step runs module by module (natively unless oneDNN takes its 85 rows, beyond the limit); the 2
    # decode steps run every layer in one native call
    prefill = 0 if copies else 1
    assert all(rows <= (limit or rows) for got in calls.values() for rows in got)
    assert 5 in calls["linear_bf16"]
    assert len(calls["linear_bf16"]) == prefill * layers + steps  # qkv; lm_head
    assert len(calls["linear_silu_mul_bf16"]) == prefill * layers
    assert len(calls["linear_add_bf16"]) == prefill * 2 * layers  # o_proj, down_proj
    assert calls["decode_layers_bf16"] == [5] * (steps - 1)


@needs_native
def test_float32_projections_read_their_weights_in_place_in_every_batch():
    """With float32 weights, every projection of every batch (a prefill's many rows, decoding's few) takes the native
    kernel on the weights as loaded, no copy: a row's numbers never depend on what else is in its step."""
    loaded = load_model(None, dtype="float32", progress=False)
    from waferscale.models.layers.linear import NativeF32Method

    proj = loaded.model.layers[0].mlp.down_proj
    assert isinstance(proj.method, NativeF32Method) and proj.method.kernels is native
    assert proj.method.weight is proj.weight and proj.weight.dtype == torch.float32
    engine = LLMEngine(loaded)
    prompts = [loaded.tokenizer.encode(f"Hello {i}, tell me a story about a cat, a dog and a bird") for i in range(3)]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=3, min_tokens=3, temperature=0))
    rows: list[int] = []
    original = native.linear_f32
    native.linear_f32 = lambda x, *a: rows.append(x.shape[0]) or original(x, *a)
    try:
        while engine.has_work():
            engine.step()
    finally:
        del native.linear_f32
    # qkv, o, gate/up and down of each layer, then the head (the prefill's scores: its prompts' last rows)
    per_layer = 4 * loaded.config.num_layers
    prefill = sum(map(len, prompts))
    assert rows == [prefill] * per_layer + [3] + ([3] * per_layer + [3]) * 2


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 33])
def test_fused_mlp_and_residual_match_the_unfused_kernels_bit_for_bit(rows):
    torch.manual_seed(0)
    k, inter = 576, 1536
    x = torch.randn(rows, k).bfloat16()
    gate_up = (torch.randn(2 * inter, k) * 0.05).bfloat16()
    down = (torch.randn(k, inter) * 0.05).bfloat16()
    residual = torch.randn(rows, k).bfloat16()
    gate, up = native.linear_bf16(x, kernels.pack_bf16(gate_up), 2 * inter, None, torch.bfloat16).split(
        [inter, inter], -1
    )
    act = native.linear_silu_mul_bf16(x, kernels.pack_bf16_pairs(gate_up), inter)
    assert torch.equal(act, F.silu(gate) * up)
    packed = kernels.pack_bf16(down)
    want = residual + native.linear_bf16(act, packed, k, None, torch.bfloat16)
    assert torch.equal(native.linear_add_bf16(act, packed, k, residual), want)


@needs_native
def test_fused_silu_of_a_hugely_negative_gate_is_zero_not_nan():
    """exp(-gate) overflows float32 below -88.7: silu is then -0 (as torch's), never inf / inf."""
    torch.manual_seed(0)
    k, inter = 576, 1536
    x = (torch.randn(1, k) * 100).bfloat16()
    gate_up = (torch.randn(2 * inter, k) * 0.05).bfloat16()
    gate, up = native.linear_bf16(x, kernels.pack_bf16(gate_up), 2 * inter, None, torch.bfloat16).split(
        [inter, inter], -1
    )
    act = native.linear_silu_mul_bf16(x, kernels.pack_bf16_pairs(gate_up), inter)
    assert (gate < -89).sum() > 100 and not act.isnan().any()
    assert torch.equal(act[gate < -89].abs(), torch.zeros(int((gate < -89).sum()), dtype=torch.bfloat16))
    torch.testing.assert_close(act, F.silu(gate) * up, atol=1e-30, rtol=0.02)  # -0 for 1e-34 from -87.5


@needs_native
@pytest.mark.skipif(native is None or not native.bf16_tiles(), reason="no AMX tiles for bf16 here")
def test_large_bf16_batches_on_amx_tiles_match_the_fma_panels():
    """From 17 rows, packed bf16 weights are multiplied on AMX tiles (no row-major copy for oneDNN): the same products
    as the FMA path within float32 rounding, for a plain output with a bias, a residual add and gate/up pairs' SiLU,
    with rows past a multiple of 32 and a K that is not a multiple of 64."""
    torch.manual_seed(2)
    k, n, inter = 96 * 3, 80, 48
    w = (torch.randn(n, k) * 0.05).bfloat16()
    bias = torch.randn(n)
    gate_up = (torch.randn(2 * inter, k) * 0.05).bfloat16()
    packed, pairs = kernels.pack_bf16(w), kernels.pack_bf16_pairs(gate_up)
    try:
        for rows in (17, 40, 64):
            x = torch.randn(rows, k).bfloat16()
            residual = torch.randn(rows, n).bfloat16()
            results = []
            for tiles in (True, False):
                native.set_amx(tiles)
                results.append((native.linear_bf16(x, packed, n, bias, torch.float32),
                                native.linear_add_bf16(x, packed, n, residual, bias),
                                native.linear_silu_mul_bf16(x, pairs, inter)))
            (plain, added, act), (plain_f, added_f, act_f) = results
            want = x.float() @ w.float().T + bias
            torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(plain, plain_f, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(added.float(), added_f.float(), rtol=2**-7, atol=1e-2)
            torch.testing.assert_close(act.float(), act_f.float(), rtol=2**-7, atol=1e-3)
            assert not torch.equal(plain, plain_f)  # another order of the sums: the tiles did run
    finally:
        native.set_amx(True)


@needs_native
def test_clamped_swiglu_is_the_float32_formula_rounded_once():
    """gpt-oss's activation of bf16 gate/up, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with
    g = min(gate, limit): PyTorch's float32 formula within a bf16 rounding, both clamps crossed, -0 (not NaN) where
    the gate is hugely negative."""
    from waferscale.models.layers.mlp import _clamped_swiglu

    torch.manual_seed(0)
    inter = 300
    gate_up = (torch.randn(7, 2 * inter) * 6).bfloat16()
    gate_up[0, :10] = -1e4
    gate, up = gate_up.float().split(inter, -1)
    assert (gate > 7).any() and (up.abs() > 7).any()
    got = native.swiglu_clamped_bf16(gate_up, 1.702, 7.0)
    assert got.shape == (7, inter) and not got.isnan().any()
    assert torch.equal(got[0, :10].float(), torch.zeros(10))
    torch.testing.assert_close(got.float(), _clamped_swiglu(gate, up, 1.702, 7.0), rtol=2**-8, atol=1e-30)


@needs_native
def test_fused_decode_attention_matches_the_pytorch_path():
    """A decode-only batch runs rope, KV write and attention in one native call; the layer's output and the keys and
    values it stores match the PyTorch ops it replaces."""
    from waferscale.engine.kv_cache import KVPool, PagedBatch

    torch.manual_seed(4)
    loaded = load_model(None, dtype="bfloat16", quantization="none", progress=False)  # bf16 weights
    cfg, model = loaded.config, loaded.model
    attn = model.layers[3].self_attn
    block_size, lengths = 16, torch.tensor([1, 16, 17, 90])
    width = int(-(-lengths.max() // block_size))
    tables = torch.arange(1, 1 + len(lengths) * width).view(len(lengths), width)
    last = lengths - 1
    slots = tables[torch.arange(len(lengths)), last // block_size] * block_size + last % block_size
    x = torch.randn(len(lengths), cfg.hidden_size).bfloat16()
    rope = model.rotary(last)
    results = []
    for fused in (True, False):
        torch.manual_seed(5)  # the same earlier keys and values in both pools
        pool = KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 + tables.numel(), block_size
        )
        pool.k.normal_()
        pool.v.normal_()
        batch = PagedBatch(pool, slots, num_decode=len(lengths), decode_tables=tables, decode_lengths=lengths)
        batch.decode_mask = (torch.arange(width * block_size)[None, :] < lengths[:, None])[:, None, None]
        batch.native = native if fused else None  # unfused: PyTorch's rope, index_copy_ and SDPA
        assert batch.can_fuse_decode(len(lengths), cfg.head_dim) is fused
        results.append((attn(x, rope, batch, 3), pool.k[3][slots].clone(), pool.v[3][slots].clone()))
    (out_f, k_f, v_f), (out_t, k_t, v_t) = results
    assert torch.equal(k_f, k_t) and torch.equal(v_f, v_t)  # rope rounds exactly as torch's bf16 ops do
    torch.testing.assert_close(out_f.float(), out_t.float(), atol=2e-2, rtol=2**-7)


def whole_layer_against_modules(model, cfg, lengths: torch.Tensor) -> None:
    """Decode one token for each of len(lengths) sequences three times: every layer in one native call, each layer
    as one native call (as when batch work may be interrupted between layers), and module by module: the same
    hidden states and stored keys and values, bit for bit."""
    import threading

    from waferscale.engine.kv_cache import KVPool, PagedBatch

    assert model.decode_layers is not None
    block_size, rows = 16, len(lengths)
    width = int(-(-lengths.max() // block_size))
    tables = torch.arange(1, 1 + rows * width).view(rows, width)
    last = lengths - 1
    slots = tables[torch.arange(rows), last // block_size] * block_size + last % block_size
    ids = torch.tensor([42, 7, 1000, 31, 5, 77, 300, 12, 9, 64, 3, 2000, 15, 8, 450, 21, 6])[:rows]
    results = []
    for mode in ("model", "layer", "modules"):
        torch.manual_seed(5)  # the same earlier keys and values in every pool
        blocks = 1 + tables.numel()
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, blocks, block_size)
        pool.k.normal_()
        pool.v.normal_()
        batch = PagedBatch(
            pool, slots, num_decode=rows, decode_tables=tables, decode_lengths=lengths, native=native,
            interrupt=threading.Event() if mode == "layer" else None,  # checked between layers: a call a layer
        )  # fmt: skip
        saved = model.decode_layers
        if mode == "modules":
            model.decode_layers = None  # each module calls its own kernel
        try:
            hidden = model(ids, last, batch)
        finally:
            model.decode_layers = saved
        results.append((hidden, pool.k[:, slots].clone(), pool.v[:, slots].clone()))
    for h, k, v in results[1:]:
        assert torch.equal(h, results[0][0]) and torch.equal(k, results[0][1]) and torch.equal(v, results[0][2])


@needs_native
def test_whole_layer_decode_call_matches_the_modules_bit_for_bit():
    """A decode-only batch runs each layer as one native call: the same hidden states and stored keys and values,
    bit for bit, as the layer's modules calling the same kernels one by one."""
    loaded = load_model(None, dtype="bfloat16", quantization="none", progress=False)  # bf16 weights
    whole_layer_against_modules(loaded.model, loaded.config, torch.tensor([1, 16, 17, 90]))


def test_loading_the_kernels_leaves_subnormal_floats_alone():
    """The library is compiled with -ffast-math but not linked with it: no flush-to-zero for the whole process."""
    kernels.load()
    tiny = 2.2250738585072014e-308  # the smallest normal double
    assert tiny / 2 > 0
    assert (torch.tensor([1e-38]) * 0.01).item() > 0  # a float32 subnormal survives
