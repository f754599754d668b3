"""Runs the engine on its own thread so the HTTP event loop never waits on a forward pass."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import AsyncIterator

from waferscale.engine.engine import LLMEngine
from waferscale.engine.outputs import GenerationEvent
from waferscale.engine.params import SamplingParams

log = logging.getLogger("waferscale.engine")


class AsyncEngine:
    """Thread-safe front of LLMEngine: `generate` yields a sequence's events as the engine thread makes them."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="waferscale-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationEvent]:
        """Events of one sequence until its finished event; closing the iterator early aborts the sequence."""
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(("add", request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def fail_all(self, message: str) -> None:
        """End every in-flight sequence with a 503 error event (their clients get an error, not silence)."""
        self._submit(("fail_all", message))

    def num_waiting(self) -> int:
        """Sequences not yet admitted: the engine's queue plus those still on their way to it."""
        return len(self.engine.waiting) + sum(1 for c in self._commands if c[0] == "add")

    def _submit(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def _run(self) -> None:
        engine = self.engine
        busy = False
        while True:
            if busy and not engine.has_work():
                busy = False
                _trim_heap()  # the engine just went idle: hand freed heap back to the OS (outside the lock)
            with self._cv:
                while not self._commands and not engine.has_work() and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "add":
                    engine.add_request(*command[1:])
                elif command[0] == "fail_all":
                    self._dispatch(engine.fail_all(command[1]))
                else:
                    engine.abort(command[1])
            if engine.has_work():
                busy = True
                try:
                    events = engine.step()
                except Exception:  # the engine isolates per-sequence failures; this is a last resort
                    log.exception("engine step failed")
                    continue
                self._dispatch(events)

    def _dispatch(self, events: list[GenerationEvent]) -> None:
        """Hand a step's events to their streams with one wake-up per event loop (not one per event)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]] = {}
        for event in events:
            target = self._streams.get(event.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], event))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Return free heap pages to the OS (glibc keeps the peak of a busy spell otherwise, and RSS creeps up)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _deliver(items: list[tuple[asyncio.Queue, GenerationEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
