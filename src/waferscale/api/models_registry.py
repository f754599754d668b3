"""The models one server serves: each configured model's name and aliases, its engine settings, and its state
(unloaded, loading, loaded, failed). A request's `model` picks its entry; a model not loaded is loaded on first use
within the memory budget, unloading the least recently used unpinned model once its in-flight requests finish.
Each loaded model has its own ServingContext: its own engine thread, KV pool and scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from waferscale.api.errors import APIError
from waferscale.api.model_loading import build_context, default_memory_budget, estimate_bytes
from waferscale.api.pipeline import Run, ServingContext, unknown_model
from waferscale.engine.settings import EngineSettings
from waferscale.models import ModelLoadError

log = logging.getLogger("waferscale.api")


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: the name clients send (and aliases), what its engine is built from, and whether it
    stays loaded (pinned: loaded at start, never unloaded)."""

    name: str
    settings: EngineSettings
    aliases: tuple[str, ...] = ()
    pinned: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP-side options every model's ServingContext shares."""

    log_requests: bool = False
    fault_injection: bool = False
    max_waiting: int | None = None
    queue_timeout: float | None = 600.0  # how long a request waits for its model to load


@dataclass
class ModelEntry:
    """A configured model's runtime state."""

    spec: ModelSpec
    ctx: ServingContext | None = None  # set while loaded
    state: str = "unloaded"  # unloaded, loading, loaded, unloading, failed
    error: str | None = None  # why the last load failed
    leases: int = 0  # requests in flight (planning, queued or generating)
    last_used: float = 0.0
    cost: int = (
        0  # bytes counted against the budget: estimate_bytes until loaded, then what its load measured
    )
    loads: int = 0
    unloads: int = 0
    loading: asyncio.Task | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def describe(self) -> dict:
        """Its /health detail."""
        out = {
            "state": self.state,
            "pinned": self.spec.pinned,
            "in_flight": self.leases,
            "memory_bytes": self.cost,
            "loads": self.loads,
            "unloads": self.unloads,
        }
        if self.ctx is not None:
            out["healthy"] = self.ctx.engine.healthy()
        if self.error:
            out["error"] = self.error
        return out


class Lease:
    """A request's hold on its model: the model is not unloaded until every lease is released. `follow(run)` hands
    the release to the run's end (a stream ends after the handler returns); otherwise leaving the `async with`
    releases it."""

    def __init__(self, entry: ModelEntry, ctx: ServingContext, release: Callable[[ModelEntry], None]):
        self.entry, self.ctx, self._release = entry, ctx, release
        self._followed = False
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.entry)

    def follow(self, run: Run) -> None:
        before = run.on_finish

        def finished(r: Run) -> None:
            try:
                if before is not None:
                    before(r)
            finally:
                self.release()

        run.on_finish = finished
        self._followed = True


BuildContext = Callable[[ModelSpec, ServerOptions], "tuple[ServingContext, int]"]


class ModelRegistry:
    """Every configured model by each of its names, loaded on demand within `memory_budget` bytes."""

    def __init__(
        self,
        specs: list[ModelSpec],
        options: ServerOptions,
        memory_budget: int | None = None,
        build: BuildContext | None = None,
    ):
        check_names(specs)
        self.entries = [ModelEntry(spec, cost=estimate_bytes(spec.settings)) for spec in specs]
        self._by_name = {n: e for e in self.entries for n in e.spec.names}
        self.options = options
        self.memory_budget = memory_budget if memory_budget is not None else default_memory_budget()
        self._build = build or build_context
        self._draining = False
        self._lock: asyncio.Lock | None = None
        self.multi = True  # False: one model given as a ServingContext (the single-model server, as before)
        self.collectors: list = []  # more prometheus collectors for /metrics (per-replica series under Ray)

    @classmethod
    def single(cls, ctx: ServingContext) -> ModelRegistry:
        """A registry of one model already loaded (the single-model server): pinned, never unloaded."""
        spec = ModelSpec(ctx.served_names[0], EngineSettings(), tuple(ctx.served_names[1:]), pinned=True)
        registry = cls([spec], ServerOptions(), memory_budget=0)
        entry = registry.entries[0]
        entry.ctx, entry.state, entry.cost = ctx, "loaded", 0
        registry.multi = False
        return registry

    @classmethod
    def serving(cls, specs: list[ModelSpec], contexts: list[ServingContext]) -> ModelRegistry:
        """A registry of several models each already served elsewhere (engine replicas on Ray Serve): all pinned
        and loaded for the server's life, none counted against a budget."""
        registry = cls([dataclasses.replace(s, pinned=True) for s in specs], ServerOptions(), memory_budget=0)
        for entry, ctx in zip(registry.entries, contexts):
            entry.ctx, entry.state, entry.cost, entry.loads = ctx, "loaded", 0, 1
        return registry

    # ------------------------------------------------------------------ names and state
    @property
    def names(self) -> list[str]:
        """Every name a request may send, in configuration order."""
        return list(self._by_name)

    def serves(self, name: str) -> bool:
        return name in self._by_name

    def entry(self, name: str) -> ModelEntry:
        """The entry `name` picks, or the hosted service's 404 listing the names served here."""
        entry = self._by_name.get(name)
        if entry is None:
            raise unknown_model(name, self.names)
        return entry

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.ctx is not None]

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """Shutting down: new completions and chats are refused (503) before they take a lease (server.py); those
        holding one are in flight and go on; the batch runner starts no new line."""
        self._draining = value

    def healthy(self) -> bool:
        """Every loaded model's engine thread runs (a model that failed to load does not make the server
        unhealthy: its requests get the load error, the others are served)."""
        return all(e.ctx.engine.healthy() for e in self.loaded())

    def fail_all(self, message: str) -> None:
        for e in self.loaded():
            e.ctx.engine.fail_all(message)

    def used_bytes(self) -> int:
        return sum(e.cost for e in self.entries if e.state in ("loaded", "loading", "unloading"))

    # ------------------------------------------------------------------ lifespan
    def start(self) -> None:
        """With the app: start the engines already loaded, and load the pinned models."""
        self._lock = asyncio.Lock()
        for e in self.entries:
            e.idle.set()
            if e.ctx is not None:
                e.ctx.engine.start()
            elif e.spec.pinned:
                e.loading = asyncio.get_running_loop().create_task(self._load(e))

    def stop(self) -> None:
        """With the app: stop every engine (after the graceful shutdown's grace)."""
        for e in self.entries:
            if e.loading is not None:
                e.loading.cancel()
            if e.ctx is not None:
                e.ctx.engine.stop()

    # ------------------------------------------------------------------ requests
    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[Lease]:
        """The model `name` picks, loaded, held until the request ends (404 for a name not served; 503 when it
        could not be loaded within the queue timeout, or its load failed)."""
        entry = self.entry(name)
        ctx = await self._ready(entry)
        entry.leases += 1
        entry.idle.clear()
        entry.last_used = time.monotonic()
        lease = Lease(entry, ctx, self._released)
        try:
            yield lease
        except BaseException:
            lease.release()
            raise
        if not lease._followed:
            lease.release()

    def _released(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()
        if entry.leases == 0:
            entry.idle.set()

    async def _ready(self, entry: ModelEntry) -> ServingContext:
        """The entry's context once loaded, loading it (or waiting for its load) as needed."""
        deadline = (
            None if self.options.queue_timeout is None else time.monotonic() + self.options.queue_timeout
        )
        while True:
            if entry.state == "loaded" and entry.ctx is not None:
                return entry.ctx
            if entry.loading is None or entry.loading.done():
                entry.loading = asyncio.get_running_loop().create_task(self._load(entry))
            task = entry.loading
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                raise APIError(
                    503,
                    f"model {entry.spec.name!r} is still loading after {self.options.queue_timeout:g} s; retry "
                    "shortly",
                    code="model_loading",
                    headers={"Retry-After": "5"},
                ) from None
            if entry.state == "failed":
                raise APIError(
                    503,
                    f"model {entry.spec.name!r} cannot be served: {entry.error}",
                    param="model",
                    code="model_unavailable",
                )

    async def _load(self, entry: ModelEntry) -> None:
        """Make room (unloading least recently used unpinned models once idle), then build the entry's engine off
        the event loop. Loads and unloads happen one at a time."""
        assert self._lock is not None, "ModelRegistry.start() runs with the app"
        async with self._lock:
            if entry.state == "loaded":
                return
            try:
                await self._make_room(entry)
            except APIError as exc:
                entry.state, entry.error = "failed", exc.message
                return
            entry.state, entry.error = "loading", None
            log.info(
                "loading model %s (%s)", entry.spec.name, entry.spec.settings.model or "the built-in model"
            )
            try:
                ctx, cost = await asyncio.to_thread(self._build, entry.spec, self.options)
            except Exception as exc:  # ModelLoadError: one clear line; anything else: its type and text
                entry.state = "failed"
                entry.error = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
                log.error("model %s failed to load: %s", entry.spec.name, entry.error)
                return
            await asyncio.to_thread(ctx.engine.start)  # its gc.collect and freeze off the event loop
            entry.ctx, entry.cost, entry.state = ctx, cost, "loaded"
            entry.loads += 1
            entry.last_used = time.monotonic()

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload least recently used unpinned models until `entry` fits the budget (each once its requests end)."""
        need = entry.cost
        if need > self.memory_budget:
            raise APIError(
                503,
                f"needs about {need >> 20} MiB, more than the whole --memory-budget ({self.memory_budget >> 20} MiB)",
            )
        while self.used_bytes() + need > self.memory_budget:
            victims = [
                e for e in self.entries if e.state == "loaded" and not e.spec.pinned and e is not entry
            ]
            if not victims:
                raise APIError(
                    503,
                    f"needs about {need >> 20} MiB and the pinned models leave "
                    f"{(self.memory_budget - self.used_bytes()) >> 20} MiB of --memory-budget "
                    f"({self.memory_budget >> 20} MiB)",
                )
            victim = min(victims, key=lambda e: e.last_used)
            victim.state = "unloading"  # new requests for it wait for its next load
            log.info(
                "unloading model %s to make room for %s (waiting for %d request(s))",
                victim.spec.name,
                entry.spec.name,
                victim.leases,
            )
            await victim.idle.wait()
            await asyncio.to_thread(_unload, victim)


def check_names(specs: list[ModelSpec]) -> None:
    """Raises ValueError when two models (or a model and an alias) share a name."""
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ValueError(
                    f"model name {name!r} is given twice"
                    if seen[name] == spec.name
                    else f"model name {name!r} is used by both {seen[name]!r} and {spec.name!r}"
                )
            seen[name] = spec.name


def _unload(entry: ModelEntry) -> None:
    """Stop the entry's engine and let its weights and KV pool go (RSS back to the heap's floor)."""
    from waferscale.heap import trim_heap

    ctx, entry.ctx = entry.ctx, None
    if ctx is not None:
        ctx.engine.stop()
    del ctx
    gc.unfreeze()  # AsyncEngine.start froze everything loaded then, this model included
    gc.collect()
    trim_heap()
    entry.state = "unloaded"
    entry.unloads += 1
