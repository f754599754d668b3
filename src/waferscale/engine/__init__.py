"""The inference engine: requests in, token events out. Knows nothing about HTTP.

Params, outputs, errors, stats, the client protocol and the engine settings need no PyTorch and are imported
eagerly; `AsyncEngine` and `LLMEngine` (PyTorch) and `build_engine` load on first use, so that the API layer and
the CLI's checks import without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waferscale.engine.errors import EngineError, ErrorKind, RequestError
from waferscale.engine.metrics import EngineStats
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams
from waferscale.engine.settings import EngineSettings

if TYPE_CHECKING:
    from waferscale.engine.async_engine import AsyncEngine
    from waferscale.engine.build import BuiltEngine, build_engine
    from waferscale.engine.llm_engine import LLMEngine

__all__ = [
    "AsyncEngine",
    "BuiltEngine",
    "EngineError",
    "EngineSettings",
    "EngineStats",
    "ErrorKind",
    "GenerationEvent",
    "LLMEngine",
    "RequestError",
    "SamplingParams",
    "TokenLogprob",
    "build_engine",
]

_LAZY = {
    "AsyncEngine": "waferscale.engine.async_engine",
    "LLMEngine": "waferscale.engine.llm_engine",
    "BuiltEngine": "waferscale.engine.build",
    "build_engine": "waferscale.engine.build",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
