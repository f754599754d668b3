"""glibc heap trimming, shared by the loader (after load) and the engine (when idle): RSS back to what is in use."""

from __future__ import annotations

import ctypes


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> None:
    """Return free heap pages to the OS (glibc keeps the peak of a busy spell otherwise, and RSS creeps up)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
