"""build_engine: the one place an engine is assembled from EngineSettings (the CLI, Ray replicas and the models
registry all call it): kernel cache caps, threads, the model load on a passing thread, the LLMEngine."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from waferscale.engine.settings import SELF_DRAFTS, EngineSettings

if TYPE_CHECKING:
    from waferscale.engine.llm_engine import LLMEngine
    from waferscale.models.loader import LoadedModel

log = logging.getLogger("waferscale")
T = TypeVar("T")


@dataclass
class BuiltEngine:
    """A loaded model and the engine serving it (not started: AsyncEngine(engine) runs it on its thread)."""

    loaded: LoadedModel
    engine: LLMEngine
    seconds: float  # how long loading and building took


def cap_kernel_caches() -> None:
    """Bound oneDNN's and ideep's per-shape caches (1,024 entries each by default): a server sees every batch size
    from 1 to max-num-batched-tokens, so the default caches alone grow RSS by hundreds of MiB over hours. Read at
    the first GEMM, so this must run before a model does; an operator's own setting wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "256")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that then exits, so that the OpenMP workers PyTorch starts for it exit too.

    The engine thread's workers are then the only ones in the process. libgomp keeps workers spinning between
    parallel regions only while it manages no more threads than there are CPUs; with the load's workers still
    parked it spins almost not at all, and each of the hundreds of small regions in a decode step waits for a
    futex wake-up instead (measured: 37-42 against 24-35 ms a token, single stream, on 2 cores).
    """
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # SystemExit and load errors included: re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="waferscale-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[return-value]


def _load_draft(settings: EngineSettings, target: LoadedModel) -> LoadedModel:
    """The draft model of --draft-model, in the target's dtype: self:int4 / self:int8 loads the target's own weights
    again with that quantization (a GGUF keeps its quantized tensors, as --quantization does), anything else is
    resolved as --model is (LLMEngine checks its tokenizer against the target's). Raises ModelLoadError."""
    from waferscale.models import ModelLoadError, load_model

    name = settings.draft_model
    own = name.removeprefix("self:") if name in SELF_DRAFTS else None
    try:
        draft = load_model(
            settings.model if own else name,
            dtype=settings.dtype,
            max_model_len=target.max_model_len if own else None,
            quantization=own or "auto",
        )
    except ModelLoadError as exc:
        raise ModelLoadError(f"--draft-model {name}: {exc}") from exc
    return draft


def build_engine(settings: EngineSettings) -> BuiltEngine:
    """Load `settings.model` and build its engine. Raises models.ModelLoadError (one clear line) when the model
    cannot be loaded."""
    cap_kernel_caches()
    import torch  # on the calling thread (the process's main thread for the CLI), as before the load thread

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)

    def build() -> BuiltEngine:
        from waferscale.engine.llm_engine import LLMEngine
        from waferscale.engine.speculation import SpeculativeConfig
        from waferscale.models import load_model

        t0 = time.perf_counter()
        loaded = load_model(
            settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            quantization=settings.quantization,
        )
        draft = _load_draft(settings, loaded) if settings.draft_model is not None else None
        engine = LLMEngine(
            loaded,
            kv_cache_bytes=settings.kv_cache_memory,
            kv_cache_dtype=settings.kv_cache_dtype,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_prefix_cache=settings.enable_prefix_cache,
            queue_timeout=settings.queue_timeout,
            speculative=SpeculativeConfig(settings.speculative, settings.num_speculative_tokens),
            draft=draft,
            draft_kv_cache_bytes=settings.draft_kv_cache_memory,
        )
        return BuiltEngine(loaded, engine, time.perf_counter() - t0)

    built = in_passing_thread(build)
    log.info(
        "loaded %s (%s, weights: %s, context %d) in %.1f s",
        built.loaded.name,
        settings.dtype,
        built.loaded.quantization,
        built.loaded.max_model_len,
        built.seconds,
    )
    return built
