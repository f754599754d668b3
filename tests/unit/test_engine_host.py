"""Several engines in one process step on one thread (one OpenMP team for all: two teams on two cores made libgomp
stop spinning and each model decode up to twice as slow), each ending on its own."""

from __future__ import annotations

import threading
import time

from waferscale.engine.async_engine import AsyncEngine, EngineHost


class Work:
    """An engine with `steps` steps of work; records the thread each step ran on."""

    def __init__(self, steps: int, fail: BaseException | None = None) -> None:
        self.left, self.fail = steps, fail
        self.threads: set[int] = set()
        self.waiting: list = []
        self.interactive_arrived = threading.Event()

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        if self.fail is not None:
            raise self.fail
        self.threads.add(threading.get_ident())
        self.left -= 1
        time.sleep(0.001)
        return []

    def fail_all(self, error) -> list:
        raise self.fail  # what a broken engine would do: the error escapes every handler


def wait_until(predicate, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_two_engines_step_on_the_same_thread():
    host = EngineHost()
    a, b = Work(50), Work(50)
    engines = [AsyncEngine(a, host), AsyncEngine(b, host)]
    for e in engines:
        e.start()
    try:
        assert wait_until(lambda: a.left == 0 and b.left == 0)
        assert len(a.threads | b.threads) == 1
    finally:
        for e in engines:
            e.stop()


def test_the_thread_ends_with_its_last_engine_and_starts_again_with_the_next():
    host = EngineHost()
    first = AsyncEngine(Work(3), host)
    first.start()
    first.stop()
    assert wait_until(lambda: host._thread is None)
    later = Work(3)
    second = AsyncEngine(later, host)
    second.start()
    try:
        assert wait_until(lambda: later.left == 0) and second.healthy()
    finally:
        second.stop()


def test_an_engine_that_breaks_ends_alone():
    class Broken(BaseException):
        pass

    host = EngineHost()
    broken, fine = AsyncEngine(Work(5, fail=Broken()), host), AsyncEngine(Work(0), host)
    broken.start()
    fine.start()
    try:
        assert wait_until(lambda: not broken.healthy())
        more = Work(20)
        late = AsyncEngine(more, host)
        late.start()
        assert wait_until(lambda: more.left == 0) and fine.healthy() and late.healthy()
        late.stop()
    finally:
        fine.stop()
        broken.stop()
