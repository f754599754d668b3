"""The inference engine: requests in, token events out. Knows nothing about HTTP."""

from waferscale.engine.async_engine import AsyncEngine
from waferscale.engine.errors import EngineError, ErrorKind, RequestError
from waferscale.engine.llm_engine import LLMEngine
from waferscale.engine.metrics import EngineStats
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineError",
    "EngineStats",
    "ErrorKind",
    "GenerationEvent",
    "LLMEngine",
    "RequestError",
    "SamplingParams",
    "TokenLogprob",
]
