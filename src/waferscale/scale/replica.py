"""An engine replica on Ray Serve: one LLMEngine on its own threads (the local AsyncEngine), streaming each
sequence's events to the front in batches (whatever a step produced), not one call per token."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator

from waferscale.engine import AsyncEngine, EngineSettings, GenerationEvent, SamplingParams
from waferscale.scale.board import REPORT_EVERY_S

log = logging.getLogger("waferscale.scale")


class EngineReplica:
    """Serve deployment class (wrapped with serve.deployment by scale/launch.py)."""

    def __init__(self, settings: EngineSettings, board):
        import ray
        from ray import serve

        from waferscale.engine import build_engine

        built = build_engine(settings)  # the CLI's own builder: same caches, threads, load
        self.loaded, engine = built.loaded, built.engine
        self.engine = AsyncEngine(engine)
        self.engine.start()
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()[:12]
        self.board = board
        self._closed = threading.Event()
        threading.Thread(target=self._post_stats, name="waferscale-stats", daemon=True).start()
        log.info("engine replica %s serving %s on %d thread(s)", self.id, self.loaded.name, settings.threads)

    def describe(self) -> dict:
        """What a front needs to plan requests for this model (the tokenizer travels pickled)."""
        loaded = self.loaded
        return {
            "name": loaded.name,
            "tokenizer": loaded.tokenizer,
            "max_model_len": loaded.max_model_len,
            "vocab_size": loaded.config.vocab_size,
            "fingerprint": loaded.fingerprint,
            "block_size": self.engine.engine.block_size,
        }

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        affinity: str | None = None,
        fault_after: int | None = None,
    ) -> AsyncIterator[list[GenerationEvent]]:
        """One sequence's events, yielded as lists of those ready together (`affinity` is read by the router)."""
        if fault_after is not None:
            self.engine.inject_fault(request_id, fault_after)
        ready: asyncio.Queue[GenerationEvent | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in self.engine.generate(request_id, prompt_ids, params):
                    ready.put_nowait(event)
            finally:
                ready.put_nowait(None)

        task = asyncio.create_task(pump())
        try:
            while True:
                first = await ready.get()
                if first is None:
                    return
                batch = [first]
                while not ready.empty():
                    event = ready.get_nowait()
                    if event is None:
                        yield batch
                        return
                    batch.append(event)
                yield batch
        finally:
            task.cancel()  # a front that went away aborts the sequence (AsyncEngine.generate's finally)

    def report(self) -> dict:
        """Waiting, running and KV use now, plus the whole stats snapshot (for the board and the router)."""
        stats = self.engine.stats()
        blocks = stats.kv_blocks_used + stats.kv_blocks_free
        return {
            "waiting": self.engine.num_waiting(),
            "running": stats.running,
            "kv_usage": stats.kv_blocks_used / blocks if blocks else 0.0,
            "healthy": self.engine.healthy(),
            "pid": os.getpid(),
            "node": self.node,
            "stats": stats,
        }

    def record_routing_stats(self) -> dict:
        """Serve's routing stats: what the affinity router weighs (scale/ray_router.py)."""
        r = self.report()
        return {"waiting": r["waiting"], "running": r["running"], "kv_usage": r["kv_usage"]}

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics: queue depth and KV use (scale/autoscale.py decides)."""
        r = self.report()
        return {"waiting": float(r["waiting"]), "running": float(r["running"]), "kv_usage": r["kv_usage"]}

    def check_health(self) -> None:
        """Serve's health check: an engine whose thread died gets the replica replaced."""
        if not self.engine.healthy():
            raise RuntimeError("the engine thread is not running")

    def _post_stats(self) -> None:
        while not self._closed.wait(REPORT_EVERY_S):
            try:
                self.board.post.remote(self.id, self.report())
            except Exception:  # the board went away with the cluster: nothing to report to
                log.debug("stats post failed", exc_info=True)

    def __del__(self) -> None:
        """Serve calls this when the replica is stopped (after in-flight requests drained)."""
        self._closed.set()
        try:
            self.board.leave.remote(self.id)
        except Exception:
            pass
        self.engine.stop()
