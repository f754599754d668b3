"""A GGUF file's metadata and tensors, read in one pass over its header.

gguf.GGUFReader builds a numpy view for every element of every metadata array: a file with a 49,152-token
vocabulary and its merges (the built-in model's) took 6-7 s to open on the 2-core test machine, at every first
start of a model. This reader parses the header with struct and mmap (0.1-0.2 s for the same file) and maps each
tensor's bytes as GGUFReader does (same shapes and dtypes), so gguf.quants.dequantize and models/quant/'s
from_gguf take them unchanged. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# scalar value types: struct code
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# tensor types stored as typed arrays (every other type: its raw bytes, uint8), as GGUFReader maps them
_TYPED = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    """One tensor: shape in GGUF's order (innermost dimension first); data mapped from the file, shaped as numpy
    wants it (outermost first; quantized types as bytes, [..., bytes a row])."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    offset: int = 0  # where data starts in the file


@dataclass
class GGUFFile:
    """metadata: key -> value (int, float, bool, str, or a list of them); value_types: key -> (type, element type
    of an array or None), as gguf.GGUFWriter.add_key_value takes them."""

    metadata: dict[str, Any]
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None = None

    def release(self, t: GGUFTensor) -> None:
        """Drop the pages of t's data from this process's RSS: every page of a mapped file once read stays
        counted until the mapping goes, and a conversion reads all of them. The data reads the same afterwards
        (the pages come back from the file)."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.offset - t.offset % mmap.PAGESIZE
        length = min(t.offset + t.data.nbytes, len(self.mapping)) - start
        if length > 0:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, length)


class _Cursor:
    """Sequential reads from the mapped header, in the file's byte order."""

    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order, self.at = buf, order, 0

    def take(self, code: str) -> Any:
        (value,) = struct.unpack_from(self.order + code, self.buf, self.at)
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.at + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = self.buf[self.at : self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        if vtype == GGUFValueType.STRING:
            return self.string(), None
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype]), None
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {int(vtype)}")
        sub, n = GGUFValueType(self.take("I")), self.take("Q")
        if sub == GGUFValueType.STRING:
            return [self.string() for _ in range(n)], sub
        if sub in _SCALARS:
            dtype = np.dtype(_SCALARS[sub]).newbyteorder(self.order)
            if self.at + n * dtype.itemsize > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype, n, self.at)
            self.at += n * dtype.itemsize
            return arr.tolist(), sub
        return [self.value(sub)[0] for _ in range(n)], sub  # arrays of arrays


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse a GGUF file (versions 2 and 3, either byte order); ValueError says what is wrong with a bad one."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ValueError(f"not a GGUF file ({exc})") from None
    try:
        return _parse(buf)
    except (struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise ValueError(f"truncated or corrupt GGUF header ({exc})") from None


def _parse(buf: mmap.mmap) -> GGUFFile:
    if buf[:4] != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in VERSIONS:
        raise ValueError(
            f"GGUF version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})"
        )
    cur = _Cursor(buf, order)
    cur.at = 8
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = GGUFValueType(cur.take("I"))
        metadata[key], sub = cur.value(vtype)
        value_types[key] = (vtype, sub)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        infos.append((name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-cur.at // align) * align
    whole = np.frombuffer(buf, dtype=np.uint8)  # the tensors view the same read-only mapping as the header
    tensors, seen = [], set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        n = int(np.prod(dims, dtype=np.int64))
        block, size = GGML_QUANT_SIZES[ttype]
        nbytes, at = n * size // block, start + offset
        if at + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        np_dims = tuple(reversed(dims))
        if ttype in _TYPED:
            dtype = np.dtype(_TYPED[ttype]).newbyteorder(order)
            data = whole[at : at + nbytes].view(dtype).reshape(np_dims)
        else:
            data = whole[at : at + nbytes].reshape(quant_shape_to_byte_shape(np_dims, ttype))
        tensors.append(GGUFTensor(name, dims, ttype, data, at))
    return GGUFFile(metadata, value_types, tensors, buf)
