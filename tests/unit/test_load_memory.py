"""Loading holds one copy of the weights: safetensors read into memory of its own (nothing of the file left mapped,
whose pages would stay in RSS) and written a tensor at a time; stacked experts (a GGUF's gate and up stacks, gpt-oss's
interleaved MXFP4 gate/up) loaded as views of one stack, checked by the tensors' storages; large bf16 weights
packed in chunks into the same panels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from waferscale.kernels import pack_bf16, pack_bf16_pairs
from waferscale.models.gpt_oss import split_gpt_oss_experts
from waferscale.models.layers import linear
from waferscale.models.layers.linear import Linear
from waferscale.models.layers.moe import GATE_UP_ROWS, split_stacked_experts, stack_gate_up
from waferscale.models.quant import quantize
from waferscale.models.quant.mxfp4 import quantize_mxfp4
from waferscale.models.safetensors_stream import (
    HUGE_MIN,
    HUGE_PAGE,
    SafetensorsWriter,
    empty_weight,
    read_tensors,
)

E, N, K = 4, 32, 256  # experts, rows of gate (and of up) an expert, in_features (int4 in two levels)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 8, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "bytes": torch.randint(0, 256, (3, 7), generator=g, dtype=torch.uint8),
    }


def test_read_tensors_gives_the_values_and_leaves_nothing_of_the_file_mapped(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    got = dict(read_tensors(path))
    assert got.keys() == _tensors().keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in _tensors().items())
    assert str(path) not in open("/proc/self/maps").read()


def _write_and_read_back(folder: Path) -> None:
    """_tensors() written a tensor at a time, read back by safetensors itself, and nothing else left in folder."""
    path = folder / "w.safetensors"
    with SafetensorsWriter(path) as out:
        for name, t in _tensors().items():
            out.add(name, t)
    got = load_file(str(path))
    assert all(torch.equal(got[k], v) for k, v in _tensors().items())
    assert [p.name for p in folder.iterdir()] == ["w.safetensors"]  # the partial file is renamed


def test_a_file_written_a_tensor_at_a_time_reads_back_with_safetensors(tmp_path):
    _write_and_read_back(tmp_path)


def test_a_header_larger_than_its_room_moves_the_data_up_in_place(tmp_path, monkeypatch):
    """The data is written after room kept for the header; a larger header moves it up in the same file (a
    conversion never needs twice its size on disk), in chunks smaller than the data here."""
    monkeypatch.setattr(SafetensorsWriter, "ROOM", 16)
    monkeypatch.setattr("waferscale.models.safetensors_stream._CHUNK", 5)
    _write_and_read_back(tmp_path)


def _load_experts(tensors: dict) -> list[Linear]:
    """Each expert's fused gate/up projection loaded from per-expert entries, as CausalLM.load_hf_state does."""
    split_stacked_experts(tensors, E)
    out = []
    for j in range(E):
        proj = Linear(K, 2 * N)
        gate = tensors.pop(f"model.layers.0.mlp.experts.{j}.gate_proj.weight")
        up = tensors.pop(f"model.layers.0.mlp.experts.{j}.up_proj.weight")
        proj.load([gate, up], None, f"experts.{j}.gate_up_proj")
        out.append(proj)
    return out


def test_quantized_gate_up_stacks_load_as_views_of_one_stack():
    """A GGUF's gate and up stacks, written as one by the conversion, give every expert's gate/up without a copy:
    one storage holds every expert's blocks, and each expert reads its own gate rows then up rows."""
    gate, up = torch.randn(E * N, K), torch.randn(E * N, K)
    qgate, qup = quantize(gate, "int4"), quantize(up, "int4")
    stack = stack_gate_up(qgate, qup, E)
    projs = _load_experts({f"model.layers.0.mlp.experts.{GATE_UP_ROWS}": stack})
    parts = [p.quant.parts for p in projs]
    assert all(len(ps) == 1 for ps in parts)
    assert stack.sup is not None
    for key in ("qweight", "scales", "mins", "sup", "supm"):
        storages = {getattr(ps[0], key).untyped_storage().data_ptr() for ps in parts}
        assert storages == {getattr(stack, key).untyped_storage().data_ptr()}
    for j, ps in enumerate(parts):
        rows = slice(j * N, (j + 1) * N)
        want = torch.cat([qgate.dequantize(rows), qup.dequantize(rows)])
        assert torch.equal(ps[0].dequantize(), want)


def test_a_conversion_writes_quantized_gate_up_as_one_stack_and_float_experts_one_by_one():
    """Quantized stacks are served in place (one stack, views); float ones are packed and freed an expert at a time,
    which a stack kept whole until its layer's last expert was done."""
    from waferscale.models.loader import _write_converted

    class Collect:
        def __init__(self):
            self.shapes = {}

        def add(self, name, t):
            self.shapes[name] = tuple(t.shape)

    q = [quantize(torch.randn(E * N, K), "int4") for _ in range(2)]
    f = [torch.randn(E, N, K) for _ in range(3)]
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    tensors = [(f"model.layers.0.mlp.experts.{n}", t) for n, t in zip(names, q)]
    tensors += [(f"model.layers.1.mlp.experts.{n}", t) for n, t in zip(names, f)]
    out = Collect()
    _write_converted(out, iter(tensors), E)
    assert out.shapes[f"model.layers.0.mlp.experts.{GATE_UP_ROWS}.qweight"] == (E * 2 * N, K // 2)
    assert not any(n.startswith("model.layers.0.mlp.experts.gate_proj") for n in out.shapes)
    assert {n for n in out.shapes if n.startswith("model.layers.1.")} == {
        f"model.layers.1.mlp.experts.{j}.{n}" for j in range(E) for n in names}
    assert out.shapes["model.layers.1.mlp.experts.3.up_proj.weight"] == (N, K)


def test_gate_and_up_in_different_layouts_are_not_stacked():
    assert stack_gate_up(quantize(torch.randn(E * N, K), "int4"), quantize(torch.randn(E * N, K), "int8"), E) is None


def test_gpt_oss_interleaved_mxfp4_gate_up_loads_as_views_of_its_stack():
    """The released checkpoint's gate/up rows alternate (gate every even row): reordered in place an expert at a
    time, each expert's gate and up are views of the stack, holding the rows they held interleaved."""
    w = quantize_mxfp4(torch.randn(E * 2 * N, K), interleaved=True)
    blocks, scales = w.qweight.view(E, 2 * N, K // 32, 16).clone(), w.scales.view(E, 2 * N, K // 32).clone()
    prefix = "model.layers.0.mlp.experts"
    tensors = {f"{prefix}.gate_up_proj_blocks": blocks, f"{prefix}.gate_up_proj_scales": scales,
               f"{prefix}.gate_up_proj_bias": torch.zeros(E, 2 * N),
               f"{prefix}.down_proj_blocks": blocks[:, :N].clone(), f"{prefix}.down_proj_scales": scales[:, :N].clone(),
               f"{prefix}.down_proj_bias": torch.zeros(E, N)}
    split_gpt_oss_experts(tensors, E, torch.bfloat16)
    projs = _load_experts(tensors)
    storages = {p.quant.parts[0].qweight.untyped_storage().data_ptr() for p in projs}
    assert storages == {blocks.untyped_storage().data_ptr()}
    for j, p in enumerate(projs):
        rows = w.dequantize(slice(j * 2 * N, (j + 1) * 2 * N))
        assert torch.equal(p.quant.parts[0].dequantize(), torch.cat([rows[0::2], rows[1::2]]))


def test_chunked_packing_gives_the_same_panels(monkeypatch):
    monkeypatch.setattr(linear, "_PACK_CHUNK_BYTES", 2 * K * 32)  # 32 rows a chunk
    for rows in (16 * 9, 1000, 33):
        w = torch.randn(rows, K).to(torch.bfloat16)
        assert torch.equal(linear.pack_bf16_chunked(w), pack_bf16(w))
    w = torch.randn(2 * 16 * 9, K).to(torch.bfloat16)
    assert torch.equal(linear.pack_bf16_chunked(w, pairs=True), pack_bf16_pairs(w))


def test_quantizing_rows_a_chunk_at_a_time_gives_the_same_blocks(monkeypatch):
    from waferscale.models.quant import layouts

    w = torch.randn(100, K)
    whole = {m: layouts._quantize_rows(w, m, 32) for m in ("int8", "int4")}
    monkeypatch.setattr(layouts, "_QUANTIZE_ROWS_WEIGHTS", 7 * K)  # 7 rows a chunk
    for method, want in whole.items():
        got = quantize(w, method)
        for key in ("qweight", "scales", "mins", "sup", "supm"):
            a, b = getattr(got, key), getattr(want, key)
            assert (a is None and b is None) or torch.equal(a, b), (method, key)


def test_fused_projections_parts_are_read_into_one_buffer(tmp_path):
    """A checkpoint's q/k/v and gate/up (an expert's too) are read as consecutive rows of one tensor, which the
    projection then takes as a view."""
    from waferscale.models.loader import _fused_destinations
    from waferscale.models.safetensors_stream import read_header

    prefix = "model.layers.0.mlp.experts.3"
    tensors = {f"{prefix}.gate_proj.weight": torch.randn(N, K).to(torch.bfloat16),
               f"{prefix}.up_proj.weight": torch.randn(N, K).to(torch.bfloat16),
               f"{prefix}.down_proj.weight": torch.randn(K, N).to(torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    got = dict(read_tensors(path, into=_fused_destinations(read_header(path)[0])))
    proj = Linear(K, 2 * N)
    proj.load([got[f"{prefix}.gate_proj.weight"], got[f"{prefix}.up_proj.weight"]], None, "gate_up_proj")
    assert proj.weight.untyped_storage().data_ptr() == got[f"{prefix}.gate_proj.weight"].untyped_storage().data_ptr()
    want = torch.cat([tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"]])
    assert torch.equal(proj.weight, want)


def test_converting_a_gguf_tensor_a_few_rows_at_a_time_gives_the_same_blocks(monkeypatch):
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from waferscale.models import gguf_reader
    from waferscale.models.quant import from_gguf

    rng = np.random.default_rng(0)
    for kind, k in (("Q4_K", 512), ("Q8_0", 64), ("Q6_K", 256), ("MXFP4", 64)):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        data = rng.integers(0, 256, (37, k // block * size), dtype=np.uint8)
        want = from_gguf(data, kind, 37, k)
        monkeypatch.setattr(gguf_reader, "_CONVERT_WEIGHTS", 5 * k)  # 5 rows at a time
        got = gguf_reader._from_gguf_rows(data, kind, 37, k)
        assert type(got) is type(want)
        for key in ("qweight", "scales", "mins", "sup", "supm"):
            a, b = getattr(got, key), getattr(want, key)
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (kind, key)


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no transparent huge pages")
def test_large_weights_start_on_a_huge_page_advised_for_huge_pages():
    """A weight from HUGE_MIN bytes starts at a 2 MiB boundary in memory advised for transparent huge pages (Linux
    gives them only where asked); a small one is a plain tensor."""
    big = empty_weight([HUGE_MIN // 2 + 3], torch.bfloat16)
    assert big.shape == (HUGE_MIN // 2 + 3,) and big.dtype == torch.bfloat16
    assert big.data_ptr() % HUGE_PAGE == 0
    flags = _vma_flags(big.data_ptr())
    if not flags:
        pytest.skip("this kernel's /proc/self/smaps shows no VmFlags")
    assert "hg" in flags
    big.fill_(1.5)  # every byte of it is usable
    assert bool((big == 1.5).all())
    small = empty_weight([4, 4], torch.float32)
    assert small.untyped_storage().nbytes() == 64
