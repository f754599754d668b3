"""Runs the engines on a thread of their own (one for all of a process's models) so the HTTP event loop never waits
on a forward pass, and supervises them.

Each command and each request is isolated: one that fails ends its own request with an error event. A step that
raises fails its sequences and the loop goes on. If an engine ever ends, every open request of it gets an
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
from waferscale.engine.params import BATCH_PRIORITY, SamplingParams
from waferscale.heap import trim_heap

log = logging.getLogger("waferscale.engine")
TRIM_INTERVAL = 30.0  # seconds of uninterrupted work between heap trims (a trim costs milliseconds)


class EngineHost:
    """The one thread that runs the steps of every engine in this process, each model's of a server of several.

    Each thread that runs PyTorch or the native kernels keeps an OpenMP team of its own, and libgomp stops spinning
    at its barriers once the teams' threads outnumber the CPUs: with two models on two engine threads, each model's
    decode steps ran up to twice as slow even while the other was idle. On one thread, the models' steps take turns
    on one team. The thread ends when its last engine does (its team with it) and starts again with the next one.
    """

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self._engines: list[AsyncEngine] = []
        self._thread: threading.Thread | None = None

    def add(self, engine: AsyncEngine) -> None:
        with self.cv:
            self._engines.append(engine)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="waferscale-engine", daemon=True)
                self._thread.start()
            self.cv.notify_all()

    def _run(self) -> None:
        engines: list[AsyncEngine] = []
        try:
            while True:
                with self.cv:
                    while self._engines and not any(e._wants_turn() for e in self._engines):
                        self.cv.wait()
                    if not self._engines:
                        self._thread = None
                        return
                    engines = list(self._engines)
                for e in engines:
                    if not e._turn():  # it has ended (stopped, or its step raised past every handler)
                        with self.cv:
                            self._engines.remove(e)
        except BaseException:  # not an engine's own failure (each turn catches its own): end them all
            log.critical("the engine thread died; no request will be served until a restart", exc_info=True)
            with self.cv:
                ending, self._engines, self._thread = list(self._engines), [], None
            for e in ending:
                e._end(_unavailable("the engine thread stopped"))
            raise


HOST = EngineHost()


def _unavailable(what: str) -> RequestError:
    return RequestError(
        ErrorKind.UNAVAILABLE, f"the inference engine stopped ({what}); this server cannot serve requests until it "
        "is restarted",
    )  # fmt: skip


class AsyncEngine:
    """Thread-safe front of LLMEngine (the interface the API talks to): `generate` yields a sequence's events as
    the engine thread makes them; `abort`, `stats`, `num_waiting` and `healthy` answer from any thread."""

    def __init__(self, engine: LLMEngine, host: EngineHost | None = None):
        self.engine = engine
        self._host = host or HOST
        self._cv = self._host.cv
        self._commands: list[tuple] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._started = False
        self._stopped = False
        self._dead: RequestError | None = None  # set once it has ended: why nothing more is served
        self._ended = threading.Event()
        self._busy = False
        self._trimmed = time.monotonic()

    def start(self) -> None:
        # Everything loaded so far (the model's modules, the libraries, the app: ~235k objects) lives as long as the
        # process: frozen, a full collection no longer walks it. Unfrozen, one took ~200 ms, holding the GIL on
        # whatever thread allocated past the threshold, and every stream missed that long.
        gc.collect()
        gc.freeze()
        self._started = True
        self._host.add(self)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._started:
            self._ended.wait(timeout=10)

    def healthy(self) -> bool:
        """Whether the engine is running and taking requests."""
        return self._started and self._dead is None

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
                if params.priority < BATCH_PRIORITY:  # a step of batch work alone stops for it
                    self.engine.interactive_arrived.set()
                self._cv.notify_all()
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
            self._cv.notify_all()

    # ------------------------------------------------------------------ on the engine thread
    def _wants_turn(self) -> bool:
        """(Under the host's lock.) Commands to apply, a step to run, an idle heap to trim, or a stop."""
        return bool(self._commands) or self._stopped or self._busy or self.engine.has_work()

    def _turn(self) -> bool:
        """Its commands, then one step if it has work; False once it has ended."""
        try:
            return self._take_turn()
        except BaseException as exc:  # fail_all raised too: this engine ends, the other models' engines go on
            log.critical("the engine stopped; no request will be served until a restart", exc_info=True)
            self._end(_unavailable(type(exc).__name__))
            return False

    def _take_turn(self) -> bool:
        engine = self.engine
        with self._cv:
            if self._stopped:
                stopped = True
            else:
                stopped, (commands, self._commands) = False, (self._commands, [])
                self.engine.interactive_arrived.clear()  # what arrived until now is in `commands`
        if stopped:
            self._end(RequestError(ErrorKind.SHUTTING_DOWN, "the server is shutting down"))
            return False
        for command in commands:
            try:
                self._apply(command)
            except Exception as exc:  # one bad command fails its own request, never the engine
                log.exception("engine command %s failed", command[0])
                if command[0] == "add":
                    self._dispatch([GenerationEvent(command[1], finished=True, error=internal_error(exc))])
        if engine.has_work():
            self._busy = True
            try:
                events = engine.step()
            except Exception as exc:  # step() isolates its own failures; this is the last resort
                log.exception("engine step failed")
                events = engine.fail_all(internal_error(exc))  # if this raises too, the engine ends
            self._dispatch(events)
            if time.monotonic() - self._trimmed > TRIM_INTERVAL:
                trim_heap()  # a load that never pauses: freed heap still goes back this often
                self._trimmed = time.monotonic()
        elif self._busy:
            self._busy = False
            trim_heap()  # the engine just went idle: hand freed heap back to the OS
            self._trimmed = time.monotonic()
        return True

    def _end(self, reason: RequestError) -> None:
        """Nothing more is served: every open request gets `reason`, new ones fail at once."""
        with self._cv:
            self._dead = reason
            streams = list(self._streams)
        self._dispatch([GenerationEvent(rid, finished=True, error=reason) for rid in streams])
        self._ended.set()

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
