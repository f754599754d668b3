"""The inference engine: requests in, token events out. Knows nothing about HTTP."""

from waferscale.engine.async_engine import AsyncEngine
from waferscale.engine.engine import LLMEngine
from waferscale.engine.outputs import GenerationEvent, TokenLogprob
from waferscale.engine.params import SamplingParams

__all__ = ["AsyncEngine", "GenerationEvent", "LLMEngine", "SamplingParams", "TokenLogprob"]
