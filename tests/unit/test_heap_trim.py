"""The engine thread hands freed heap back to the OS when it goes idle and, under a load that never pauses, every
TRIM_INTERVAL seconds: a server busy for weeks must not keep the heap's high-water mark."""

from __future__ import annotations

import resource
import threading
import time

import torch

from waferscale.engine import async_engine
from waferscale.engine.async_engine import AsyncEngine
from waferscale.heap import keep_freed_heap


class EndlessWork:
    """An engine whose batch never empties until released; each step takes a millisecond."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting: list = []
        self.interactive_arrived = threading.Event()

    def has_work(self) -> bool:
        return not self.release.is_set()

    def step(self) -> list:
        time.sleep(0.001)
        return []


def run_busy(monkeypatch, interval: float, seconds: float) -> int:
    trims = []
    monkeypatch.setattr(async_engine, "trim_heap", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(async_engine, "TRIM_INTERVAL", interval)
    work = EndlessWork()
    engine = AsyncEngine(work)
    engine.start()
    time.sleep(seconds)
    busy_trims = len(trims)
    work.release.set()
    engine.stop()
    return busy_trims


def test_a_load_that_never_pauses_still_trims_the_heap(monkeypatch):
    assert run_busy(monkeypatch, interval=0.05, seconds=0.5) >= 3


def test_no_trim_between_steps_before_the_interval(monkeypatch):
    assert run_busy(monkeypatch, interval=60, seconds=0.3) == 0


def test_starting_the_engine_freezes_what_is_loaded():
    """Full collections skip the objects that live as long as the process (they took ~200 ms, holding the GIL)."""
    import gc

    loaded = [[] for _ in range(1000)]  # noqa: F841  (tracked objects alive across the start)
    gc.unfreeze()
    work = EndlessWork()
    work.release.set()
    engine = AsyncEngine(work)
    try:
        engine.start()
        assert gc.get_freeze_count() >= 1000
    finally:
        engine.stop()
        gc.unfreeze()


def _faults_of_steps(steps: int) -> int:
    """Page faults of `steps` rounds that each allocate, fill and free six 8 MiB buffers, as a prefill step does;
    this thread's only (servers other tests left running fault pages of their own in the same process)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(steps):
        buffers = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(6)]
        del buffers
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_a_steps_buffers_reuse_the_memory_the_last_step_freed():
    """With glibc's defaults each round faults its 48 MiB in again (the freed heap top is trimmed: about 12,000
    pages a round, 6,000 of them in this thread, the rest in the thread that fills the other half); kept, once the
    heap has settled (a round or two after the first) the rounds fault nothing. Among the suite's other threads the
    heap may still grow once more (1,024 faults seen): the bound is one round's, a tenth of what the 10 rounds fault
    without the settings."""
    assert keep_freed_heap()  # glibc took both settings
    _faults_of_steps(3)
    assert _faults_of_steps(10) < 6000
