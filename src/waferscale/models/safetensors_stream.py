"""safetensors files read and written one tensor at a time, through plain file reads and writes.

Why not safetensors.torch's load_file/save_file: load_file maps the file, and every page a tensor ever read stays
in the process's RSS for as long as any tensor of the file lives (a copied weight is then resident twice); save_file
turns every tensor into a bytes object before writing any (a second copy of everything written). Reading each
tensor into memory of its own, and writing each as it comes, keeps a load at one copy of the weights.
Format: https://github.com/huggingface/safetensors (8-byte header length, JSON header, data).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 1 << 26  # bytes a read or write call moves at most (Linux moves at most 2 GiB in one)


def _raw(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
HUGE_MIN = 16 << 20  # tensors from this size get huge pages: fewer TLB misses when a token streams through them


@functools.cache
def _libc():
    """The C library, for madvise."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _madvise_huge(addr: int, length: int) -> bool:
    """Ask Linux for transparent huge pages (MADV_HUGEPAGE) on [addr, addr + length); False where it declines."""
    return _libc().madvise(addr, length, 14) == 0  # 14: MADV_HUGEPAGE


def empty_weight(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a weight: from HUGE_MIN bytes, placed at a 2 MiB boundary and advised to be
    backed by transparent huge pages before any of it is touched (Linux's default is to give them only where asked,
    and a decode step reads every weight once: a 178 MB embedding head read 4 KiB page by page took 10 ms a token
    against 7 with huge pages). What follows the last whole huge page keeps small pages, so nothing is wasted."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_MIN or sys.platform != "linux":
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    whole = (nbytes // HUGE_PAGE) * HUGE_PAGE
    _madvise_huge(raw.data_ptr() + start, whole)
    return raw[start : start + nbytes].view(dtype).view(shape)


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(the header: name -> {dtype, shape, data_offsets}, metadata dropped; where the data starts)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensors(
    path: str | os.PathLike, names: list[str] | None = None, into: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor (of `names`, or all, in file order) read into memory of its own, or into the tensor `into`
    gives for its name (of its shape and dtype): nothing of the file stays mapped."""
    header, start = read_header(path)
    wanted = sorted(header if names is None else names, key=lambda k: header[k]["data_offsets"][0])
    with open(path, "rb", buffering=0) as f:
        for name in wanted:
            info = header[name]
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            t = (into or {}).get(name)
            if t is None:
                t = empty_weight(info["shape"], DTYPES[info["dtype"]])
            elif list(t.shape) != info["shape"] or t.dtype != DTYPES[info["dtype"]] or not t.is_contiguous():
                raise ValueError(f"{path}: tensor {name!r} does not fit the destination given for it")
            if t.numel() * t.element_size() != end - begin:
                raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {info['shape']}")
            buf, done = _raw(t), 0
            while done < len(buf):
                got = os.preadv(f.fileno(), [buf[done : done + _CHUNK]], start + begin + done)
                if got <= 0:
                    raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
                done += got
            yield name, t


class SafetensorsWriter:
    """A safetensors file written a tensor at a time, as the tensors come: the data is written after room kept for
    the header (whose size is known only at the end), and `close` writes the header there, padded with spaces as
    safetensors pads it. A header larger than that room moves the data up in place, from its end: the file never
    needs twice its size on disk (a 20 GB conversion would need 40)."""

    ROOM = 1 << 20  # bytes kept for the header: about 7,000 tensors' entries

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._data = open(self._partial, "w+b")
        self._data.seek(8 + self.ROOM)
        self._header: dict[str, dict] = {}
        self._at = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._header:
            raise ValueError(f"tensor {name!r} written twice")
        t = t.detach().contiguous()
        raw = _raw(t)
        for i in range(0, len(raw), _CHUNK):
            self._data.write(raw[i : i + _CHUNK])
        self._header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._at, self._at + len(raw)]}
        self._at += len(raw)

    def close(self) -> None:
        header = json.dumps(self._header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data 8-byte aligned, as safetensors writes it
        fd, start = self._data.fileno(), 8 + self.ROOM
        self._data.flush()
        if len(header) <= self.ROOM:
            header += b" " * (self.ROOM - len(header))
        else:  # move the data up by the difference, last chunk first, so that no byte is overwritten unread
            shift, end = len(header) - self.ROOM, start + self._at
            os.ftruncate(fd, end + shift)
            while end > start:
                begin = max(start, end - _CHUNK)
                os.pwrite(fd, os.pread(fd, end - begin, begin), begin + shift)
                end = begin
        os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
        self._data.close()
        os.replace(self._partial, self.path)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self._data.close()
            self._partial.unlink(missing_ok=True)
