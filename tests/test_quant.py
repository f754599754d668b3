"""Quantized weights: every GGUF format decodes exactly (the real Gemma 3 270M's too), the integer kernels match a
float reference (AVX2 and the portable path), GGUF Q8_0/Q4_K/Q5_0 files load and answer from their blocks, and
--quantization int8 keeps greedy tokens."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import fresh_cache
from gguf.quants import dequantize

from waferscale import kernels
from waferscale.engine import LLMEngine, SamplingParams
from waferscale.models import builtin_model_path, load_model
from waferscale.models.gguf_file import read_gguf_file
from waferscale.models.quant import QuantLinear, QuantWeight, from_gguf, quantize

native = kernels.load()
needs_native = pytest.mark.skipif(native is None, reason="native kernels could not be built here")
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# bytes of each block and where its float16 fields lie (the rest: random bytes are valid quantized values)
_LAYOUT = {
    "Q8_0": (34, [0]),
    "Q4_0": (18, [0]),
    "Q4_1": (20, [0, 2]),
    "Q5_0": (22, [0]),
    "Q5_1": (24, [0, 2]),
    "Q4_K": (144, [0, 2]),
    "Q5_K": (176, [0, 2]),
    "Q6_K": (210, [208]),
}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of a format for an [n, k] weight, as uint8 [n, bytes a row]; float16 fields ~ 0.01."""
    rng = np.random.default_rng(seed)
    size, halves = _LAYOUT[kind]
    per_row = k // (256 if kind.endswith("_K") else 32)
    blocks = rng.integers(0, 256, (n * per_row, size), dtype=np.uint8)
    for at in halves:
        d = rng.uniform(0.002, 0.02, n * per_row).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, per_row * size)


def reference(kind: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32))


@pytest.mark.parametrize("kind", FORMATS)
def test_every_gguf_format_decodes_exactly(kind):
    n, k = 24, 512
    blocks = random_blocks(kind, n, k)
    w = from_gguf(blocks, kind, n, k)
    want = reference(kind, blocks).reshape(n, k)
    assert torch.equal(w.dequantize(), want)
    if native is not None:
        assert torch.equal(native.qdequant(w), want)
        assert torch.equal(native.qdequant(w, slice(5, 9)), want[5:9])
        ids = torch.tensor([7, 0, 23, 7])
        assert torch.equal(native.qdequant_rows(w, ids), want[ids])


def _native_table(w: QuantWeight):
    """A token table of these blocks, its lookup chosen as a model's load chooses it (the native kernels here)."""
    from waferscale.models.layers.linear import LoadContext
    from waferscale.models.quant import QuantEmbedding

    table = QuantEmbedding(w, torch.bfloat16)
    table.process_weights_after_loading(LoadContext(torch.bfloat16, native, False))
    return table


@needs_native
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K", "Q6_K", "int8", "int4"])
def test_a_quantized_embedding_looks_rows_up_natively_with_the_same_values(kind):
    """A quantized token table (GGUF blocks, or --quantization's layouts) read by the native lookup gives the rows
    the PyTorch ops give, in the model's dtype."""
    if kind.startswith("int"):
        w = quantize(torch.randn(40, 512, generator=torch.Generator().manual_seed(3)), kind)
    else:
        w = from_gguf(random_blocks(kind, 40, 512, seed=3), kind, 40, 512)
    table = _native_table(w)
    assert table.native is native
    ids = torch.tensor([[3, 39, 0], [17, 3, 8]])
    table.native = None  # the PyTorch ops' rows
    want = table(ids)
    table.native = native
    assert torch.equal(table(ids), want)


@needs_native
@pytest.mark.parametrize("bad", [40, -1])
def test_a_token_id_past_the_table_is_an_index_error(bad):
    """An id outside the table raises before anything is read (a negative one too: no id counts from the end)."""
    table = _native_table(from_gguf(random_blocks("Q8_0", 40, 512, seed=3), "Q8_0", 40, 512))
    with pytest.raises(IndexError, match=f"row {bad} is out of range for a weight of 40 rows"):
        table(torch.tensor([1, bad]))


def test_the_real_gemma_files_blocks_decode_exactly(gemma3_gguf):
    """The real Gemma 3 270M's first layer, which holds each of its formats (Q4_K, Q5_0, Q6_K, Q8_0), decodes as
    gguf.quants decodes it."""
    kinds = set()
    for t in read_gguf_file(gemma3_gguf).tensors:
        if not t.name.startswith("blk.0.") or len(t.shape) != 2:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        w = from_gguf(np.asarray(t.data), t.tensor_type.name, n, k)
        assert w is not None, (t.name, t.tensor_type.name)
        want = reference(t.tensor_type.name, np.asarray(t.data)).reshape(n, k)
        assert torch.equal(w.dequantize(), want), t.name
        kinds.add(t.tensor_type.name)
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


# bytes a weight of our layouts: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 keep their float16 scales (and mins), the K-quants their two
# levels (a byte per group, a float32 per 256 weights); values take a byte, five bits for Q5_0/Q5_1 (as the file
# holds them), or a nibble for the 4-bit formats
BYTES_A_WEIGHT = {
    "Q8_0": 1.0625,
    "Q4_0": 0.625,
    "Q4_1": 0.625,
    "Q5_0": 0.6875,
    "Q5_1": 0.75,
    "Q4_K": 0.59375,
    "Q5_K": 1.09375,
    "Q6_K": 0.828125,
}


@pytest.mark.parametrize("kind", FORMATS)
def test_gguf_blocks_keep_their_scales_as_stored(kind):
    n, k = 8, 512
    w = from_gguf(random_blocks(kind, n, k), kind, n, k)
    assert w.nbytes() == BYTES_A_WEIGHT[kind] * n * k
    assert w.scale_format == (2 if kind.endswith("_K") else 1)  # two-level, or float16


# batches of at least this many rows take the float32 path's dequantized panels (quant_kernels.c's PANEL_ROWS), fewer
# the row-by-row kernel: each is batch-invariant, the two sum in different orders
PANEL_ROWS = 6
# auto rounds activations to int8 below these batch sizes (INT8_ROWS_K for two-level layouts: 16 with AVX2, 28 where
# AVX-512 VNNI takes the batches; INT8_ROWS_Q8 for 8-bit blocks), and takes the float32 paths from them on
INT8_ROWS_K, INT8_ROWS_Q8 = (native.int8_rows_k(), native.int8_rows_q8()) if native else (16, 12)
# where the CPU has AMX, auto takes the int8 tiles from these batch sizes instead (quant_kernels.c's AMX_ROWS_*); where
# it has none, their vector counterparts (gemm_vnni with AVX-512 VNNI, gemm_i8v with AVX2) from the row paths' limits
AMX_ROWS_K, AMX_ROWS_Q8 = 16, 3
TILE_ROWS = {"amx": (AMX_ROWS_K, AMX_ROWS_Q8), "vectors": (INT8_ROWS_K, INT8_ROWS_Q8)}
# the vectors round a K-quant batch's activations per 256, as the row path does (gemm_i8k, AVX2 or AVX-512)
VECTORS_BLOCK_K = native.int8_vectors_block_k() if native else 0
# auto rounds one-level 4-bit blocks' activations to int8 per 32 below this batch size (gemm_i4m), then takes the int8
# vectors (AVX-512 VNNI: int8 per 32 too) or int16 per 32 (gemm_i16b); 0 in the portable build
INT8_ROWS_4 = native.int8_rows_4() if native else 0


# qgemm's activation modes (quant.ACTIVATION_MODES)
FLOAT32, INT8, AUTO = 0, 1, 2


def _eight_bit(w: QuantWeight) -> bool:
    """Q8_0, Q5_0 and --quantization int8's layouts: signed bytes (or Q5_0's signed 5 bits), a scale per 32, no
    mins."""
    return w.bits in (8, 5) and w.signed and w.group == 32 and w.mins is None and w.scale_format != 2


def _tiles(lib) -> str | None:
    """Which int8 batch kernel auto takes on this CPU: AMX tiles, vectors (AVX-512 VNNI or AVX2: the same sums), or
    none (the portable build)."""
    return "amx" if lib.set_amx(True) else "vectors" if lib.set_int8_vectors(True) else None


def _one_level_4bit(w: QuantWeight) -> bool:
    """Q4_0, Q4_1 and --quantization int4 where not two-level: unsigned 4-bit blocks of 32 with one-level scales and
    mins."""
    return w.bits == 4 and not w.signed and w.group == 32 and w.scale_format != 2


def _fewest_tile_rows(w: QuantWeight, tiles: str) -> int:
    """The batch size from which the tiles (or their VNNI counterpart) take this layout."""
    if _one_level_4bit(w):
        return INT8_ROWS_4
    k_rows, q8_rows = TILE_ROWS[tiles]
    return q8_rows if _eight_bit(w) else k_rows


def _tile_rows(w: QuantWeight, act: int, rows: int, tiles: str | None) -> bool:
    """Whether auto multiplies this batch by the int8 tiles (or VNNI vectors): 8-bit blocks and the two-level layouts
    (Q4_K, Q5_K, Q6_K) from their TILE_ROWS; int8 activations per 32."""
    if not (tiles and act == AUTO):
        return False
    two_level_32 = w.group == 32 and not w.signed  # Q4_K, Q5_K
    q6k = w.group == 16 and w.signed and w.bits in (8, 6) and w.mins is None
    served = _eight_bit(w) or (w.scale_format == 2 and (two_level_32 or q6k))
    served = served or (_one_level_4bit(w) and native.int8_vectors_4())  # the VNNI vectors, not AMX's int8 tiles
    return served and rows >= _fewest_tile_rows(w, tiles)


def _int8_block(w: QuantWeight, act: int, rows: int, tiles: str | None = None) -> int | None:
    """The block over which a mode rounds activations to int8 for this weight and batch, or None (float32, or
    int16: _int16_rows)."""
    if _tile_rows(w, act, rows, tiles) and tiles == "vectors" and w.scale_format == 2:
        return VECTORS_BLOCK_K
    if act == INT8 or _tile_rows(w, act, rows, tiles):
        return 32
    if act != AUTO or not native_avx2():
        return None
    if w.scale_format == 2 and w.in_features % 256 == 0:  # the K-quants: per 256, integer sums over each super-block
        return 256 if rows < INT8_ROWS_K else None
    if _one_level_4bit(w):
        return 32 if rows < INT8_ROWS_4 else None
    return 32 if _eight_bit(w) and rows < INT8_ROWS_Q8 else None


def _int16_rows(w: QuantWeight, act: int, rows: int) -> bool:
    """Whether auto rounds this batch's activations to int16 per 32: Q5_1's one-level unsigned blocks of 32 with mins
    (in 5 bits or a byte) row by row below PANEL_ROWS (gemm_i16), 16 rows a vector from there (gemm_i16b); one-level
    4-bit blocks from INT8_ROWS_4 rows where the int8 vectors do not take them (gemm_i16b)."""
    if _one_level_4bit(w):
        return act == AUTO and native_avx2() and rows >= INT8_ROWS_4 and not native.int8_vectors_4()
    one_level = w.scale_format != 2 and w.group == 32 and not w.signed and w.bits in (5, 8)
    return act == AUTO and native_avx2() and one_level


def native_avx2() -> bool:
    """The K-quant int8 path exists in the AVX2 build only (the portable one takes float32)."""
    return os.environ.get("WAFERSCALE_NATIVE_KERNELS") != "portable"


def _check_matmul(w: QuantWeight, dense: torch.Tensor, lib) -> None:
    tiles = _tiles(lib)
    for rows in (1, 3, 6, 9, 13, 17):
        x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows))
        want = x @ dense.T
        y, one = torch.empty(rows, w.out_features), torch.empty(1, w.out_features)
        for act in (FLOAT32, INT8, AUTO):
            block, levels = _int8_block(w, act, rows, tiles), 127
            if _int16_rows(w, act, rows):
                block, levels = 32, 32767
            lib.qgemm(x, w, y, act=act)
            # each row's result does not depend on the others in the batch (within one path)
            lib.qgemm(x[-1:].contiguous(), w, one, act=act)
            # auto: 17 rows are float32, 1 is int8 (or int16)
            alone_same_path = (_int8_block(w, act, 1), _int16_rows(w, act, 1)) == (
                _int8_block(w, act, rows, tiles),
                _int16_rows(w, act, rows),
            )
            if _tile_rows(w, act, rows, tiles):  # the tiles: the fewest rows that take them too
                fewest = _fewest_tile_rows(w, tiles)
                part = torch.empty(fewest, w.out_features)
                lib.qgemm(x[-fewest:].contiguous(), w, part, act=act)
                assert torch.equal(part[-1], y[-1])
                if _eight_bit(w) or _one_level_4bit(w):  # one row's products, summed otherwise (K-quants: per 256)
                    assert ((one[0] - y[-1]).norm() / y[-1].norm()) < 1e-5
            elif (block and not _int16_rows(w, act, rows)) or rows < PANEL_ROWS:
                assert torch.equal(one[0], y[-1])
            else:  # the panels (or the int16 batches): the fewest rows that take them too
                fewer = next(n for n in range(PANEL_ROWS, rows + 1) if _int8_block(w, act, n) is None)
                part = torch.empty(fewer, w.out_features)
                lib.qgemm(x[-fewer:].contiguous(), w, part, act=act)
                assert torch.equal(part[-1], y[-1])
                if alone_same_path:
                    assert ((one[0] - y[-1]).norm() / y[-1].norm()) < 1e-5  # float32 sums in another order
            if block is None:  # float32 activations: float32 rounding only
                assert ((y - want).norm() / want.norm()) < 1e-5
                continue
            # activations rounded to int8 (int16) per block (step max|x| / 127 (32767) over the block): each product
            # is off by at most half a step times |w|, the bound below (plus float32 rounding)
            step = x.abs().view(rows, -1, block).amax(-1, keepdim=True).expand(-1, -1, block).reshape(rows, -1)
            bound = (step / levels / 2) @ dense.abs().T
            assert ((y - want).abs() <= bound * 1.001 + 1e-5).all(), (rows, act)
            assert ((y - want).norm() / want.norm()) < (0.03 if levels == 127 else 1e-4)
        lib.qgemm(x.bfloat16(), w, y)  # bf16 rows are read as they are
        torch.testing.assert_close(y, x.bfloat16().float() @ dense.T, rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("kind", FORMATS + ["int8", "int4", "int8-g64"])
def test_integer_kernel_matches_float_reference(kind):
    n, k = 40, 512
    if kind.startswith("int"):
        dense = torch.randn(n, k)
        w = quantize(dense, kind[:4], group=64 if kind.endswith("g64") else 32)
        dense = w.dequantize()
    else:
        blocks = random_blocks(kind, n, k, seed=1)
        w = from_gguf(blocks, kind, n, k)
        dense = reference(kind, blocks).reshape(n, k)
    _check_matmul(w, dense, native)


@needs_native
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1"])
def test_large_int16_batches_give_each_row_what_a_small_batch_gives(kind):
    """Batches of 32 rows and more of the one-level blocks with mins take two groups of 16 rows a pass (gemm_i16b
    with AVX-512): a row gets the bits it gets in the fewest rows that take int16 (PANEL_ROWS; the 4-bit blocks:
    INT8_ROWS_4), whichever group and lane it lands in."""
    n, k = 40, 512
    w = from_gguf(random_blocks(kind, n, k, seed=3), kind, n, k)
    fewest = PANEL_ROWS  # the portable build: float32 panels, as batch-invariant
    if _one_level_4bit(w) and INT8_ROWS_4:
        if native.int8_vectors_4():
            pytest.skip("the 4-bit blocks' batches take the int8 vectors here (test_integer_kernel_matches_...)")
        fewest = INT8_ROWS_4
    rows = max(72, 64 + fewest)  # the last row checked (64) has `fewest` rows from it
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    y = torch.empty(rows, n)
    native.qgemm(x, w, y, act=AUTO)
    for r in (0, 15, 16, 31, 32, 47, 63, 64):
        few = torch.empty(fewest, n)
        native.qgemm(x[r : r + fewest].contiguous(), w, few, act=AUTO)
        assert torch.equal(few[0], y[r])


@needs_native
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 16, 33])
@pytest.mark.parametrize("act", [FLOAT32, INT8, AUTO])
def test_packed_5_and_6_bit_blocks_give_what_the_same_values_as_bytes_give(kind, rows, act):
    """Q5_0/Q5_1 (int5) and Q6_K (int6) kept in their bits: every path (each batch size's, each activation mode's)
    gives bit for bit what it gives for the same values held a byte a weight, the layout they had before."""
    n, k = 40, 512
    w = from_gguf(random_blocks(kind, n, k, seed=3), kind, n, k)
    assert w.bits == (6 if kind == "Q6_K" else 5)
    as_bytes = QuantWeight(
        w.values().to(torch.int8 if w.signed else torch.uint8).contiguous(),
        w.scales, w.mins, 8, w.group, w.signed, w.sup, w.supm,
    )
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got, want = (torch.empty(rows, n, dtype=torch.bfloat16) for _ in range(2))
    native.qgemm(x, w, got, act=act)
    native.qgemm(x, as_bytes, want, act=act)
    assert torch.equal(got, want)


@needs_native
@pytest.mark.parametrize("tiles", ["amx", "vectors"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_tiles_give_each_row_the_integer_sums(kind, tiles):
    """Where the CPU has AMX, auto multiplies 8-bit blocks from 3 rows, and Q4_K, Q5_K and Q6_K from 16, by tiles;
    elsewhere (or with AMX off), by vectors from INT8_ROWS_Q8 (5 with AVX-512 VNNI, 12 with AVX2) and INT8_ROWS_K (28
    or 16): 33 rows (two tile groups and a part) against 100 weight rows (three 32-row tasks and 4 rows past them)
    give each row, bias included, the products of its int8 activations (per 32) with the weights as the int8 mode
    sums them (the vectors' K-quants: per 256, as each row alone sums them), within float32 rounding; each row the
    same bits in the fewest rows the tiles take; with AMX, for 8-bit blocks, the very bits the row alone gets (its own
    kernel sums and scales each block as the tiles do: a speculative verification step's rows give what one-row
    decoding gives); bf16 out with a residual is those sums rounded as torch rounds them."""
    if tiles == "amx" and not native.set_amx(True):
        pytest.skip("no AMX on this CPU (or the OS does not grant it)")
    if tiles == "vectors":
        native.set_amx(False)
        if not native.set_int8_vectors(True):
            native.set_amx(True)
            pytest.skip("no int8 vector kernels in this build")
    try:
        _check_tile_sums(kind, tiles)
    finally:
        native.set_amx(True)


def _check_tile_sums(kind: str, tiles: str) -> None:
    n, rows = 100, 33
    k = 768 if kind.endswith("_K") else 640
    w = from_gguf(random_blocks(kind, n, k, seed=5), kind, n, k)
    gen = torch.Generator().manual_seed(6)
    x, bias = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    y = torch.empty(rows, n)
    native.qgemm(x, w, y, bias=bias, act=AUTO)
    products = torch.empty(rows, n)
    if _int8_block(w, AUTO, rows, tiles) == 256:  # the vectors round x per 256, as a row alone does (gemm_k)
        for r in range(rows):
            native.qgemm(x[r : r + 1].contiguous(), w, products[r : r + 1], bias=bias, act=AUTO)
    else:  # act=int8: every layout's int8 products per 32, without tiles
        native.qgemm(x, w, products, bias=bias, act=INT8)
    assert ((y - products).norm() / products.norm()) < 1e-5
    dense = torch.empty(rows, n)
    native.qgemm(x, w, dense, bias=bias, act=FLOAT32)
    assert ((y - dense).norm() / dense.norm()) < 0.01  # and int8 activations stay close to float32's
    fewest = _fewest_tile_rows(w, tiles)
    part = torch.empty(fewest, n)
    native.qgemm(x[-fewest:].contiguous(), w, part, bias=bias, act=AUTO)
    assert torch.equal(part, y[-fewest:])
    for r in range(rows if tiles == "amx" and _eight_bit(w) else 0):  # AMX, 8-bit blocks: one row alone, same bits
        one = torch.empty(1, n)
        native.qgemm(x[r : r + 1].contiguous(), w, one, bias=bias, act=AUTO)
        assert torch.equal(one[0], y[r]), r
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    native.qgemm(x, w, out, bias=bias, residual=residual, act=AUTO)
    assert torch.equal(out, residual + y.bfloat16())


@needs_native
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_a_step_verifying_drafts_gives_each_row_of_int8_blocks_what_it_gets_alone(kind):
    """A speculative verification step (rows_exact) multiplies 8-bit blocks and one-level 4-bit blocks row by row up
    to 11 rows, as one row is (otherwise the vectors take 8-bit batches from 5 rows with AVX-512 VNNI, and 4-bit ones
    from INT8_ROWS_4, summing each block's products otherwise), so a draft's row gets the numbers decoding it alone
    gets; the setting is undone after. K 608: an odd number of blocks; N 42: one row's last pass of 4 weight rows
    holds 2."""
    n, k, rows = 42, 608, 11
    w = from_gguf(random_blocks(kind, n, k, seed=3), kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    y, one = torch.empty(rows, n), torch.empty(1, n)
    limit = native.int8_rows_4 if _one_level_4bit(w) else native.int8_rows_q8
    before = limit()
    if not before:
        pytest.skip("the portable build multiplies batches in float32 panels from 6 rows")
    with native.rows_exact():
        assert limit() == 12
        native.qgemm(x, w, y, act=AUTO)
        pair = torch.empty(2, n)  # two rows: a pass of 4 weight rows with AVX2 too, as one row takes
        native.qgemm(x[:2].contiguous(), w, pair, act=AUTO)
        assert torch.equal(pair, y[:2])
        for r in range(rows):
            native.qgemm(x[r : r + 1].contiguous(), w, one, act=AUTO)
            assert torch.equal(one[0], y[r]), r
    assert limit() == before


@needs_native
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_a_step_verifying_drafts_keeps_k_quants_row_by_row_below_32_rows_with_avx2(kind):
    """With AVX2, auto takes the K-quants' batches to int8 vectors (gemm_i8k) from 16 rows, but a speculative
    verification step (rows_exact) keeps them row by row below 32 (gemm_k, as one row is), so each row of a 20-row
    step gets the numbers decoding it alone gets, where outside such a step the batch's rows differ from them in
    float32 rounding; the setting is undone after."""
    before = native.int8_rows_k()
    if before in (0, 28):
        pytest.skip("the portable build (float32 panels) or AVX-512 VNNI's limit, the same in both steps")
    assert before == 16
    n, k, rows = 42, 512, 20
    w = from_gguf(random_blocks(kind, n, k, seed=5), kind, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    y, one = torch.empty(rows, n), torch.empty(1, n)
    native.qgemm(x, w, y, act=AUTO)
    alone = torch.empty(rows, n)
    for r in range(rows):
        native.qgemm(x[r : r + 1].contiguous(), w, alone[r : r + 1], act=AUTO)
    assert not torch.equal(y, alone)  # the batch took gemm_i8k
    with native.rows_exact():
        assert native.int8_rows_k() == 32
        native.qgemm(x, w, y, act=AUTO)
        for r in range(rows):
            native.qgemm(x[r : r + 1].contiguous(), w, one, act=AUTO)
            assert torch.equal(one[0], y[r]), r
    assert native.int8_rows_k() == before


@needs_native
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1"])
def test_amx_bf16_tiles_give_one_level_blocks_their_float_sums(kind):
    """Where the CPU has AMX, auto multiplies Q4_0, Q4_1 and Q5_1 from 4 bf16 rows by bf16 tiles, q and x exact in bf16: 33 rows against 100 weight rows (three 32-row tasks and 4 rows past
    them) give the float64 reference's sums within float32 rounding; each row the same bits in a batch of 4 as in the
    batch of 33; bf16 out with a residual is those sums rounded as torch rounds them."""
    if not native.set_amx(True):
        pytest.skip("no AMX on this CPU (or the OS does not grant it)")
    n, rows, k = 100, 33, 608
    w = from_gguf(random_blocks(kind, n, k, seed=7), kind, n, k)
    gen = torch.Generator().manual_seed(8)
    x, bias = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    exact = x.double() @ w.dequantize().double().T + bias.double()
    y = torch.empty(rows, n)
    native.qgemm(x, w, y, bias=bias, act=AUTO)
    assert ((y.double() - exact).norm() / exact.norm()) < 1e-5
    for r0 in (0, 29):
        four = torch.empty(4, n)
        native.qgemm(x[r0 : r0 + 4].contiguous(), w, four, bias=bias, act=AUTO)
        assert torch.equal(four, y[r0 : r0 + 4]), r0
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    native.qgemm(x, w, out, bias=bias, residual=residual, act=AUTO)
    assert torch.equal(out, residual + y.bfloat16())


# every layout the float32 kernels specialise on: int8 signed g32 (Q8_0, Q5_0), int8 signed g16 (Q6_K), int8 unsigned
# with mins (Q5_K two-level, Q5_1 float16), int4 with mins (Q4_1), int4 symmetric-looking Q4_0 (mins -8 d)
LAYOUTS = {"Q8_0": 608, "Q5_0": 608, "Q6_K": 768, "Q5_K": 768, "Q5_1": 608, "Q4_1": 608, "Q4_0": 96}


def _check_layouts(lib, rows_list=(1, 3, 5, 8, 33)) -> None:
    """qgemm on random blocks of each layout, bf16 rows in and bf16 out with a bias and the residual add, against the
    float reference (QuantWeight.dequantize, a float64 matmul, torch's bf16 roundings). 40 output rows: a short last
    panel; K past one 256-column chunk, and not a multiple of it (608)."""
    n = 40
    for kind, k in LAYOUTS.items():
        w = from_gguf(random_blocks(kind, n, k, seed=3), kind, n, k)
        dense = w.dequantize().double()
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).bfloat16()
            residual = torch.randn(m, n, generator=gen).bfloat16()
            exact = x.double() @ dense.T + bias.double()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            lib.qgemm(x, w, out, bias=bias, residual=residual)
            want = (residual.float() + exact.float().bfloat16().float()).bfloat16()
            # float32 sums round differently from float64's, and may land on the other side of a bf16 rounding
            atol = 1e-2 * exact.abs().max().item()
            torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=atol)
            plain = torch.empty(m, n)
            lib.qgemm(x, w, plain, bias=bias)
            assert ((plain.double() - exact).norm() / exact.norm()) < 1e-5, (kind, m)


@needs_native
def test_float32_kernels_match_the_reference_on_every_layout():
    _check_layouts(native)


def test_quantizers_are_close_to_the_weights():
    w = torch.randn(64, 256)
    for method, tol in (("int8", 0.01), ("int4", 0.12)):
        q = quantize(w, method)
        assert ((q.dequantize() - w).norm() / w.norm()) < tol
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize(torch.randn(4, 48), "int8")


def test_int4_takes_q4k_two_levels_where_k_is_a_multiple_of_256():
    assert quantize(torch.randn(8, 512), "int4").scale_format == 2  # bytes per 32 times a float32 per 256
    assert quantize(torch.randn(8, 512), "int4").nbytes() == 0.59375 * 8 * 512
    assert quantize(torch.randn(8, 96), "int4").scale_format == 0  # float32 scale and min per 32


@needs_native
@pytest.mark.parametrize("variant", ["portable", "avx2"])
def test_other_builds_give_the_same_answers(tmp_path, variant):
    """WAFERSCALE_NATIVE_KERNELS=portable builds the plain-C paths (as on a CPU without AVX2), =avx2 this CPU's
    features less AVX-512, AVX-VNNI and AMX (as on a Zen 2/3 EPYC); both agree with the reference."""
    script = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_quant import FORMATS, random_blocks, reference, _check_matmul, _check_layouts
from waferscale import kernels
from waferscale.models.quant import from_gguf, quantize
lib = kernels.load()
assert lib is not None
for kind in FORMATS:
    blocks = random_blocks(kind, 16, 256, seed=2)
    w = from_gguf(blocks, kind, 16, 256)
    dense = reference(kind, blocks).reshape(16, 256)
    assert torch.equal(lib.qdequant(w), dense)
    assert torch.equal(lib.qdequant_rows(w, torch.tensor([15, 0, 3])), dense[[15, 0, 3]])
    _check_matmul(w, dense, lib)
_check_layouts(lib, rows_list=(1, 8))
x, w = torch.randn(3, 1539), torch.randn(9, 1539)  # float32 weights too (cpu_kernels.c)
torch.testing.assert_close(lib.linear_f32(x, w), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)
assert torch.equal(lib.linear_f32(x[1:2], w), lib.linear_f32(x, w)[1:2])
assert not kernels.cpu_has_native_bf16() or {variant!r} != "avx2"  # served as on a CPU that emulates bf16
if {variant!r} == "avx2":  # the AVX2 int8 vectors sum as the tiles do
    from test_quant import _check_tile_sums
    for kind in ("Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"):
        _check_tile_sums(kind, "vectors")
print("build ok")
print(lib.lib._name)
"""
    # the suite's kernel cache: this build is compiled once a suite (test_gpt_oss's kernel tests load it too)
    env = dict(os.environ, WAFERSCALE_NATIVE_KERNELS=variant, WAFERSCALE_CACHE_DIR=str(fresh_cache(tmp_path)))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "build ok" in done.stdout
    so = done.stdout.split("build ok\n")[1].splitlines()[0]
    assert Path(so).resolve() != Path(native.lib._name).resolve()  # its own build, not the native one
    if shutil.which("objdump"):
        code = subprocess.run(["objdump", "-d", so], capture_output=True).stdout
        # the portable build has no AVX2 integer dot products in it (the compiler may still vectorise its plain
        # C for this CPU); the AVX2 one has them, and no AVX-512 or AMX register
        assert (b"vpmaddubsw" in code) == (variant == "avx2")
        assert variant != "avx2" or (b"zmm" not in code and b"tmm" not in code)


def _greedy(loaded, ids: list[int], n: int) -> list[int]:
    engine = LLMEngine(loaded, kv_cache_bytes=16 << 20)
    engine.add_request("t", ids, SamplingParams(max_tokens=n, temperature=0, min_tokens=n))
    out: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids
    return out


def write_tiny_gguf(path, kinds: dict[str, str]) -> None:
    """A 2-layer llama GGUF (hidden 256) with the built-in model's tokenizer, its projections in the formats given
    per tensor kind (attn_q, ffn_down, ...; default Q8_0), its embeddings in Q8_0."""
    src = read_gguf_file(builtin_model_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in src.metadata.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, value, *src.value_types[key])
    hidden, inter, heads, kv_heads, layers, vocab = 256, 512, 4, 2, 2, 49152
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)

    def quantized(name: str, kind: str, n: int, k: int, seed: int) -> None:
        blocks = random_blocks(kind, n, k, seed)
        writer.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))

    seed = 10
    quantized("token_embd.weight", "Q8_0", vocab, hidden, seed)
    head = heads * hidden // heads
    shapes = {
        "attn_q": (head, hidden),
        "attn_k": (kv_heads * hidden // heads, hidden),
        "attn_v": (kv_heads * hidden // heads, hidden),
        "attn_output": (hidden, head),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    for i in range(layers):
        for kind, (n, k) in shapes.items():
            seed += 1
            quantized(f"blk.{i}.{kind}.weight", kinds.get(kind, "Q8_0"), n, k, seed)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TINY_LAYERS = {
    # q, k, o, gate, up in Q4_K, v in Q6_K (two parts of qkv), down in Q5_K
    "k-quants": {k: "Q4_K" for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")}
    | {"attn_v": "Q6_K", "ffn_down": "Q5_K"},
    # Q5_0 (a signed byte and a float16 scale) beside Q8_0 in qkv, Q5_1 (a byte, float16 scale and min) for down
    "q5": {k: "Q5_0" for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} | {"ffn_down": "Q5_1"},
}


@pytest.mark.parametrize(
    "name,kinds",
    [
        ("Q8_0", {}),
        ("Q4_K", TINY_LAYERS["k-quants"]),
        ("Q5", TINY_LAYERS["q5"]),
    ],
)
def test_quantized_gguf_loads_and_answers_from_its_blocks(tmp_path, monkeypatch, name, kinds):
    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny.{name}.gguf"
    write_tiny_gguf(path, kinds)
    served = load_model(path, dtype="bfloat16", quantization="auto", progress=False)
    assert served.quantization == "gguf"
    linears = [m for m in served.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied head
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 2 for p in served.model.parameters())
    if name == "Q4_K":  # q, k in Q4_K and v in Q6_K stay two parts, each in its own layout
        qkv = served.model.layers[0].self_attn.qkv_proj.quant
        assert [(p.bits, p.group) for p in qkv.parts] == [(4, 32), (6, 16)]
    exact = load_model(path, dtype="float32", progress=False)  # today's path: dequantized float32
    assert exact.quantization == "none"
    ids = served.tokenizer.encode("Hello there, how are you")
    got = _greedy(served, ids, 6)
    assert len(got) == 6
    # the float32 forward from quantized blocks (float32 activations through the integer kernel) tracks the
    # dequantized model's logits closely
    f32q = load_model(path, dtype="float32", quantization="int8", progress=False)
    assert f32q.quantization == "gguf"
    from test_models import our_logits

    a, b = our_logits(f32q, ids), our_logits(exact, ids)
    assert ((a - b).norm() / b.norm()) < 0.03


@pytest.fixture(scope="module", params=list(TINY_LAYERS))
def tiny_quantized(request, tmp_path_factory):
    """The tiny GGUF with its projections in the formats TINY_LAYERS names, served in bf16."""
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / "tiny.gguf"
    write_tiny_gguf(path, TINY_LAYERS[request.param])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WAFERSCALE_CACHE_DIR", str(tmp / "cache"))
        return load_model(path, dtype="bfloat16", quantization="auto", progress=False)


@needs_native
@pytest.mark.parametrize("rows", [2, 7, 17])  # the integer paths at 2 and 7 rows; the float32 panels at 17
def test_whole_layer_decode_call_matches_the_quantized_modules_bit_for_bit(tiny_quantized, rows):
    """Quantized projections run in the one-call decode layer too, bit for bit as the modules."""
    from test_kernels import whole_layer_against_modules

    loaded = tiny_quantized
    assert isinstance(loaded.model.decode_layers[0].qkv, list)
    lengths = torch.tensor([1, 16, 17, 90, 3, 40, 8, 5, 2, 33, 64, 7, 11, 1, 20, 9, 12])[:rows]
    whole_layer_against_modules(loaded.model, loaded.config, lengths)


def test_int8_quantization_keeps_greedy_tokens(tmp_path, monkeypatch, hf_tokenizer):
    """A tiny random llama made decisive: embeddings of norm ~sqrt(hidden) dominate the residual stream, and the
    untied head is the embeddings permuted, so each greedy step answers perm[last token] by a wide margin while
    every projection (at the default init) still shapes the logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "tiny-hf"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
        ref.model.embed_tokens.weight.copy_(embed)
        perm = torch.randperm(cfg.vocab_size)
        ref.lm_head.weight.copy_(embed[torch.argsort(perm)])
    ref.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)  # the built-in model's tokenizer, as transformers reads it
    exact = load_model(folder, dtype="float32", progress=False)
    q8 = load_model(folder, dtype="bfloat16", quantization="int8", progress=False)
    assert q8.quantization == "int8"
    assert isinstance(q8.model.lm_head.quant, QuantLinear)
    ids = exact.tokenizer.encode("The three primary colours are")
    want = _greedy(exact, ids, 8)
    from test_models import our_logits

    logits = our_logits(exact, ids + want[:-1])[len(ids) - 1 :]
    top = logits.topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min() > 5  # decisive
    assert len(set(want)) == 8
    assert _greedy(q8, ids, 8) == want
    # cached: a second load reads the quantized shards (one per source shard)
    cached = list((tmp_path / "cache" / "quantized").glob("*/int8/complete"))
    assert len(cached) == 1 and list(cached[0].parent.glob("*.safetensors"))
    assert (
        load_model(folder, dtype="bfloat16", quantization="int8", progress=False).fingerprint
        == q8.fingerprint
    )
