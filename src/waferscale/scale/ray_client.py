"""The front's engine client for replicas on Ray Serve (the EngineClient the local AsyncEngine also implements).

A sequence is one streaming call to a replica, chosen by the affinity router from the request's affinity key. A
replica that dies mid-sequence ends it with a clear `unavailable` error (503; an error chunk on a stream); a
sequence that had produced nothing is sent once more, and Serve routes it to a live replica."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError

from waferscale.engine import ErrorKind, GenerationEvent, RequestError, SamplingParams
from waferscale.engine.errors import internal_error
from waferscale.engine.metrics import EngineStats, HistogramSnapshot
from waferscale.scale.board import REPORT_EVERY_S
from waferscale.scale.routing import affinity_key

log = logging.getLogger("waferscale.scale")


class RayEngineClient:
    """Replicas behind one Serve deployment handle, with the board's per-replica stats for /metrics and 429s."""

    def __init__(self, handle, board, block_size: int, affinity: bool):
        self.handle = handle.options(stream=True)
        self.board, self.block_size, self.affinity = board, block_size, affinity
        self.replicas: dict[str, dict] = {}  # the board's latest snapshot: replica id -> report
        self.retries = 0  # sequences sent again after their replica died before producing anything
        self.replica_failures = 0  # sequences ended by their replica's death
        self._faults: dict[str, int] = {}
        self._poller: asyncio.Task | None = None
        self._heard = time.monotonic()

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while True:
            try:
                self.replicas = await self.board.snapshot.remote()
                self._heard = time.monotonic()
            except Exception:
                log.warning("could not read the replicas' stats", exc_info=True)
            await asyncio.sleep(REPORT_EVERY_S)

    def healthy(self) -> bool:
        """Some replica is serving (reported healthy within the board's staleness window)."""
        return any(r["healthy"] for r in self.replicas.values()) and time.monotonic() - self._heard < 10

    def num_waiting(self) -> int:
        """The shortest replica queue: a request is refused (429) only when every replica's queue is full."""
        return min((r["waiting"] for r in self.replicas.values()), default=0)

    def inject_fault(self, request_id: str, after_tokens: int) -> None:
        self._faults[request_id] = after_tokens

    def fail_all(self, message: str) -> None:
        """Nothing to do here: Serve drains and stops the replicas themselves on shutdown."""

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_key: str | None = None
    ) -> AsyncIterator[GenerationEvent]:
        key = affinity_key(prompt_ids, cache_key, self.block_size) if self.affinity else None
        fault = self._faults.pop(request_id, None)
        for attempt in (0, 1):
            produced = finished = False
            stream = self.handle.generate.remote(request_id, prompt_ids, params, affinity=key, fault_after=fault)
            try:
                async for batch in stream:
                    for event in batch:
                        produced, finished = True, event.finished
                        yield event
                return
            except RayActorError as exc:
                if not produced and attempt == 0:
                    self.retries += 1
                    log.warning("replica died before %s produced anything; sending it again", request_id)
                    continue
                self.replica_failures += 1
                log.warning("replica died while serving %s: %s", request_id, type(exc).__name__)
                error = RequestError(
                    ErrorKind.UNAVAILABLE,
                    "the engine replica serving this request stopped; retry it (other replicas are serving)",
                )
                yield GenerationEvent(request_id, finished=True, error=error)
                return
            except Exception as exc:
                log.exception("replica call for %s failed", request_id)
                yield GenerationEvent(request_id, finished=True, error=internal_error(exc))
                return
            finally:
                if not finished:
                    stream.cancel()  # the front stopped listening (or the call failed): abort it there

    def per_replica(self) -> dict[str, EngineStats]:
        return {r: report["stats"] for r, report in self.replicas.items()}

    def stats(self) -> EngineStats:
        """Totals over the live replicas (histograms merged bucket by bucket)."""
        total = EngineStats()
        for stats in self.per_replica().values():
            for name in EngineStats.GAUGES + EngineStats.COUNTERS:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            total.ttft = _merge(total.ttft, stats.ttft)
            total.itl = _merge(total.itl, stats.itl)
            for layer, counts in stats.expert_load.items():
                mine = total.expert_load.setdefault(layer, [0] * len(counts))
                total.expert_load[layer] = [a + b for a, b in zip(mine, counts)]
        return total


def _merge(a: HistogramSnapshot | None, b: HistogramSnapshot | None) -> HistogramSnapshot | None:
    if a is None or b is None:
        return dataclasses.replace(a or b) if (a or b) else None
    return HistogramSnapshot(a.buckets, [x + y for x, y in zip(a.counts, b.counts)], a.total + b.total)
