"""The one interface the API layer talks to an engine through: the local AsyncEngine (engine/async_engine.py) and
the Ray replicas' client (scale/ray_client.py) both implement it, so the HTTP front does not know which it has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from waferscale.engine.metrics import EngineStats
from waferscale.engine.outputs import GenerationEvent
from waferscale.engine.params import SamplingParams


class EngineClient(Protocol):
    """Requests in, events out, plus what the front needs for health, backpressure and /metrics."""

    def start(self) -> None:
        """Called once when the app starts (the local engine starts its thread)."""

    def stop(self) -> None:
        """Called once when the app stops."""

    def healthy(self) -> bool:
        """Whether requests can be served now."""

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_key: str | None = None
    ) -> AsyncIterator[GenerationEvent]:
        """Events of one sequence until its finished event; closing the iterator early aborts the sequence.
        `cache_key` is the request's prompt_cache_key: engines spread over replicas route by it."""

    def num_waiting(self) -> int:
        """Sequences waiting for admission where the next request would go (for the 429 check)."""

    def stats(self) -> EngineStats:
        """A monitoring snapshot (totals over replicas where there are several)."""

    def fail_all(self, message: str) -> None:
        """End every in-flight sequence with a shutting-down error."""

    def inject_fault(self, request_id: str, after_tokens: int) -> None:
        """Test hook: the request fails after `after_tokens` tokens (call before generate)."""
