"""Our GGUF header reader (models/gguf_file.py) against gguf's own GGUFReader, on small files the gguf package
writes here: the same metadata, value types, tensor shapes, dtypes and bytes; bad files refused with a ValueError."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from waferscale.models.gguf_file import read_gguf_file


def write_sample(path, endian: gguf.GGUFEndian) -> None:
    """Every kind of metadata value the loader meets (scalars, strings, arrays of numbers and of strings) and
    tensors in float, integer and quantized types, one not a multiple of the alignment."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_block_count(2)  # uint32
    w.add_layer_norm_rms_eps(1e-5)  # float32
    w.add_key_value("sample.u8", 7, gguf.GGUFValueType.UINT8)
    w.add_key_value("sample.i64", -3, gguf.GGUFValueType.INT64)
    w.add_key_value("sample.f64", 0.25, gguf.GGUFValueType.FLOAT64)
    w.add_key_value("sample.flag", True, gguf.GGUFValueType.BOOL)
    w.add_key_value("sample.text", "héllo ▁world", gguf.GGUFValueType.STRING)
    w.add_token_list(["<s>", "a", "ĠThe", "", "日本"])
    w.add_token_types([3, 1, 1, 1, 1])
    w.add_token_merges(["a b", "Ġ T"])
    w.add_key_value(
        "sample.floats", [0.5, -1.5, 2.0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32
    )
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    q8 = quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_reads_what_ggufreader_reads(tmp_path, endian):
    path = tmp_path / "sample.gguf"
    write_sample(path, endian)
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == {k: f.contents() for k, f in fields.items()}
    for key, f in fields.items():
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        assert ours.value_types[key] == (f.types[0], sub)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.shape == tuple(b.shape.tolist()) and a.tensor_type == b.tensor_type
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_metadata_values_come_back_as_written(tmp_path):
    path = tmp_path / "sample.gguf"
    write_sample(path, gguf.GGUFEndian.LITTLE)
    meta = read_gguf_file(path).metadata
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "a", "ĠThe", "", "日本"]
    assert meta["sample.text"] == "héllo ▁world"
    assert meta["sample.i64"] == -3 and meta["sample.flag"] is True and meta["llama.block_count"] == 2


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf_file(path)


@pytest.mark.parametrize("keep", [0, 6, 40, 200])
def test_a_truncated_file_is_refused(tmp_path, keep):
    full = tmp_path / "sample.gguf"
    write_sample(full, gguf.GGUFEndian.LITTLE)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:keep])
    with pytest.raises(ValueError):
        read_gguf_file(cut)


def test_tensor_data_past_the_end_is_refused(tmp_path):
    full = tmp_path / "sample.gguf"
    write_sample(full, gguf.GGUFEndian.LITTLE)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:-64])  # the last tensor has 136 bytes, then at most 31 of padding
    with pytest.raises(ValueError, match="runs past the end"):
        read_gguf_file(cut)
