"""How a configured model becomes a ServingContext, and what it counts against the memory budget: its estimate
before the first load (weights on disk plus KV cache), what the process grew by while loading it after."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from waferscale.api.pipeline import ServingContext
from waferscale.engine.settings import EngineSettings

if TYPE_CHECKING:
    from waferscale.api.models_registry import ModelSpec, ServerOptions

log = logging.getLogger("waferscale.api")
MEMORY_MARGIN = 2**30  # what the default budget leaves to the rest of the process and the machine (or 10%)


def build_context(spec: ModelSpec, options: ServerOptions) -> tuple[ServingContext, int]:
    """A ServingContext serving `spec` on its own engine (engine/build.py), and the bytes it holds."""
    from waferscale.engine import AsyncEngine, build_engine
    from waferscale.heap import trim_heap
    from waferscale.models.chat_template import ChatTemplate

    trim_heap()
    before = _rss()
    built = build_engine(spec.settings)
    trim_heap()
    grown = _rss() - before
    loaded = built.loaded
    ctx = ServingContext(
        engine=AsyncEngine(built.engine),
        tokenizer=loaded.tokenizer,
        served_names=[n for n in spec.names],
        max_model_len=loaded.max_model_len,
        vocab_size=loaded.config.vocab_size,
        fingerprint=loaded.fingerprint,
        log_requests=options.log_requests,
        fault_injection=options.fault_injection,
        max_waiting=options.max_waiting,
        chat_template=ChatTemplate.for_tokenizer(loaded.tokenizer),
    )
    estimate = estimate_bytes(spec.settings)
    log.info(
        "model %s holds about %d MiB (the process grew by %d MiB loading it; estimated %d MiB)",
        spec.name,
        max(estimate, grown) >> 20,
        grown >> 20,
        estimate >> 20,
    )
    return ctx, max(estimate, grown)


def _rss() -> int:
    """This process's resident memory in bytes (0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def estimate_bytes(settings: EngineSettings) -> int:
    """Before a model's first load: its weights' size on disk (a GGUF, or a folder's safetensors; doubled when a
    quantized GGUF is dequantized), plus its KV cache, and its draft model's weights and KV cache where it has one."""
    target = _on_disk(settings.model)
    if target is None:
        return 0  # it takes nothing: its load fails, with this message
    total = _loaded_bytes(*target, settings) + settings.kv_cache_memory
    draft = settings.draft_model
    if draft is not None:
        on_disk, is_file = target
        if draft.startswith("self:"):
            # the target again: a GGUF's blocks as they are; bf16 weights halved or quartered
            total += on_disk if is_file else on_disk // (2 if draft == "self:int8" else 4)
        else:
            total += _loaded_bytes(*(_on_disk(draft) or (0, False)), settings)
        total += settings.draft_kv_cache_memory or settings.kv_cache_memory // 4
    return total


def _on_disk(model: str) -> tuple[int, bool] | None:
    """(a model's weights on disk: a GGUF, or a folder's safetensors; whether it is one file), None where the
    path is not a model."""
    from waferscale.models import ModelLoadError, model_source

    try:
        src = model_source(model)
    except ModelLoadError:
        return None
    files = [src] if src.is_file() else list(Path(src).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files), src.is_file()


def _loaded_bytes(on_disk: int, is_file: bool, settings: EngineSettings) -> int:
    """Weights once loaded: a quantized GGUF dequantized takes 2 (bf16) or 4 (float32) times its blocks."""
    if is_file and (settings.quantization == "none" or settings.dtype == "float32"):
        return on_disk * (4 if settings.dtype == "float32" else 2)
    return on_disk


def default_memory_budget() -> int:
    """The machine's memory less a margin (1 GiB or a tenth, whichever is more); unbounded where unknown."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                return total - max(MEMORY_MARGIN, total // 10)
    except OSError:
        pass
    return 2**62
