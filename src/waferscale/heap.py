"""glibc heap policy, shared by the loader (after load) and the engine: what a step frees is kept for the next step
while work goes on, and handed back to the OS (RSS back to what is in use) when it pauses."""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks this size or larger still get their own mapping
TRIM_THRESHOLD = 1 << 30  # free heap top kept between trims


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return None, None


_MALLOC_TRIM, _MALLOPT = _load_libc()


def trim_heap() -> None:
    """Return free heap pages to the OS (glibc keeps the peak of a busy spell otherwise, and RSS creeps up)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def keep_freed_heap() -> bool:
    """Serve a step's buffers (up to 32 MiB each) from memory earlier steps freed, instead of new pages from the OS.

    By default glibc maps large blocks on their own and unmaps them when freed, and trims the heap's free top, so
    each step faults its buffers in again, every page zeroed by the kernel (in a VM, several microseconds a page);
    trim_heap, called when the engine goes idle and every TRIM_INTERVAL of work, still hands the memory back.
    Returns whether glibc took both settings."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(_MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
