"""Runs the engine on its own thread so the HTTP event loop never waits on a forward pass, and supervises it.

Each command and each request is isolated: one that fails ends its own request with an error event. A step that
raises fails its sequences and the loop goes on. If the thread itself ever ends, every open request gets an
`unavailable` error, `healthy()` turns False, and new requests fail at once instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator

from waferscale.engine.errors import ErrorKind, RequestError, internal_error
from waferscale.engine.llm_engine import LLMEngine
from waferscale.engine.metrics import EngineStats
from waferscale.engine.outputs import GenerationEvent
from waferscale.engine.params import SamplingParams
from waferscale.heap import trim_heap

log = logging.getLogger("waferscale.engine")
TRIM_INTERVAL = 30.0  # seconds of uninterrupted work between heap trims (a trim costs milliseconds)



class AsyncEngine:
    """Thread-safe front of LLMEngine (the interface the API talks to): `generate` yields a sequence's events as
    the engine thread makes them; `abort`, `stats`, `num_waiting` and `healthy` answer from any thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._dead: RequestError | None = None  # set once the thread has ended: why nothing more is served
        self._thread = threading.Thread(target=self._run, name="waferscale-engine", daemon=True)

    def start(self) -> None:
        # Everything loaded so far (the model's modules, the libraries, the app: ~235k objects) lives as long as the
        # process: frozen, a full collection no longer walks it. Unfrozen, one took ~200 ms, holding the GIL on
        # whatever thread allocated past the threshold, and every stream missed that long.
        gc.collect()
        gc.freeze()
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def healthy(self) -> bool:
        """Whether the engine thread is running and taking requests."""
        return self._dead is None and self._thread.is_alive()

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_key: str | None = None
    ) -> AsyncIterator[GenerationEvent]:
        """Events of one sequence until its finished event; closing the iterator early aborts the sequence.
        (`cache_key` only routes between replicas: one engine finds its cached prefixes by their tokens.)"""
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        with self._cv:
            dead = self._dead
            if dead is None:
                self._streams[request_id] = (asyncio.get_running_loop(), queue)
                self._commands.append(("add", request_id, prompt_ids, params))
                self._cv.notify()
        if dead is not None:
            yield GenerationEvent(request_id, finished=True, error=dead)
            return
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
        """End every in-flight sequence with a shutting-down error (their clients get an error, not silence)."""
        self._submit(("fail_all", RequestError(ErrorKind.SHUTTING_DOWN, message)))

    def inject_fault(self, request_id: str, after_tokens: int) -> None:
        """Test hook: the request fails while sampling once it has `after_tokens` tokens (call before generate)."""
        self._submit(("fault", request_id, after_tokens))

    def num_waiting(self) -> int:
        """Sequences not yet admitted: the engine's queue plus those still on their way to it."""
        return len(self.engine.waiting) + sum(1 for c in self._commands if c[0] == "add")

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _submit(self, command: tuple) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        reason = RequestError(ErrorKind.SHUTTING_DOWN, "the server is shutting down")
        try:
            self._loop()
        except BaseException as exc:
            log.critical("the engine thread died; no request will be served until a restart", exc_info=True)
            reason = RequestError(
                ErrorKind.UNAVAILABLE,
                f"the inference engine stopped ({type(exc).__name__}); this server cannot serve requests until it "
                "is restarted",
            )
        finally:
            with self._cv:
                self._dead = reason
                streams = list(self._streams)
            self._dispatch([GenerationEvent(rid, finished=True, error=reason) for rid in streams])

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        trimmed = time.monotonic()
        while True:
            if busy and not engine.has_work():
                busy = False
                trim_heap()  # the engine just went idle: hand freed heap back to the OS (outside the lock)
                trimmed = time.monotonic()
            elif busy and time.monotonic() - trimmed > TRIM_INTERVAL:
                trim_heap()  # a load that never pauses: freed heap still goes back this often
                trimmed = time.monotonic()
            with self._cv:
                while not self._commands and not engine.has_work() and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                try:
                    self._apply(command)
                except Exception as exc:  # one bad command fails its own request, never the thread
                    log.exception("engine command %s failed", command[0])
                    if command[0] == "add":
                        self._dispatch(
                            [GenerationEvent(command[1], finished=True, error=internal_error(exc))]
                        )
            if engine.has_work():
                busy = True
                try:
                    events = engine.step()
                except Exception as exc:  # step() isolates its own failures; this is the last resort
                    log.exception("engine step failed")
                    events = engine.fail_all(internal_error(exc))  # if this raises too, the thread ends
                self._dispatch(events)

    def _apply(self, command: tuple) -> None:
        engine = self.engine
        if command[0] == "add":
            engine.add_request(*command[1:])
        elif command[0] == "fail_all":
            self._dispatch(engine.fail_all(command[1]))
        elif command[0] == "fault":
            engine.faults.fail_after[command[1]] = command[2]
        else:
            engine.abort(command[1])

    def _dispatch(self, events: list[GenerationEvent]) -> None:
        """Hand a step's events to their streams with one wake-up per event loop (not one per event)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerationEvent]]] = {}
        for event in events:
            target = self._streams.get(event.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass


def _deliver(items: list[tuple[asyncio.Queue, GenerationEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
