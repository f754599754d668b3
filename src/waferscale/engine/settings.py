"""EngineSettings: everything an engine is built from, filled by every launcher (the CLI, Ray replicas, a models
file) and read by `build_engine` (engine/build.py). No PyTorch here: launchers check settings before loading it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
SPECULATIONS = ("ngram", "draft", "none")
SELF_DRAFTS = ("self:int4", "self:int8")  # --draft-model: the target's own weights again, quantized
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")
DEFAULT_KV_CACHE_BYTES = 512 * 2**20


class SettingsError(ValueError):
    """A setting an engine cannot be built from; the message names the option to change."""


@dataclass(frozen=True)
class EngineSettings:
    """One engine's model and its serving options (the CLI's --model, --dtype, ... with the same defaults)."""

    model: str | None = None  # a GGUF file, a Hugging Face folder, a built-in name; None: the built-in model
    dtype: str = "bfloat16"
    quantization: str = "auto"
    max_model_len: int | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_BYTES
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: the model's default (engine/step_budget.py)
    enable_prefix_cache: bool = True
    queue_timeout: float | None = 600.0
    speculative: str = "ngram"
    num_speculative_tokens: int = 8
    draft_model: str | None = None  # speculative draft: a GGUF file, a Hugging Face folder, a built-in name, self:int4
    draft_kv_cache_memory: int | None = None  # the draft's KV pool; None: a quarter of kv_cache_memory
    threads: int | None = (
        None  # torch threads set before loading; None: as the process was planned (threads.py)
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SettingsError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise SettingsError(
                f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SettingsError(
                f"kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.speculative not in SPECULATIONS:
            raise SettingsError(f"speculative {self.speculative!r} is not one of {', '.join(SPECULATIONS)}")
        if self.num_speculative_tokens < 1:
            raise SettingsError(
                "num-speculative-tokens must be at least 1 (speculative none turns speculation off)"
            )
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise SettingsError(
                "speculative draft needs a draft-model"
                if self.draft_model is None
                else f"a draft-model is given but speculative is {self.speculative}: drop one of them"
            )
        if self.draft_model is not None and self.draft_model.startswith("self:") and self.draft_model not in SELF_DRAFTS:
            raise SettingsError(
                f"draft-model {self.draft_model!r}: choose {' or '.join(SELF_DRAFTS)} (the target's weights "
                "quantized), or a GGUF file, a Hugging Face folder or a built-in model name"
            )
        if self.draft_kv_cache_memory is not None and self.draft_kv_cache_memory < 1:
            raise SettingsError(f"draft-kv-cache-memory must be at least 1, not {self.draft_kv_cache_memory}")
        for name in ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingsError(f"{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise SettingsError(f"threads must be at least 1, not {self.threads}")

    def replace(self, **changes) -> EngineSettings:
        """A copy with `changes` (checked as a new one is)."""
        return dataclasses.replace(self, **changes)


def settings_from_args(args) -> EngineSettings:
    """The engine settings of a parsed `waferscale serve` or `complete` command line (a parser's defaults where a
    command has no such option). Raises SettingsError."""
    return EngineSettings(
        model=args.model or None,  # one path: cli.main has taken a single --model out of its list
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        kv_cache_memory=getattr(args, "kv_cache_memory", DEFAULT_KV_CACHE_BYTES),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        max_num_seqs=getattr(args, "max_num_seqs", 64),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        enable_prefix_cache=not getattr(args, "no_prefix_cache", False),
        queue_timeout=getattr(args, "queue_timeout", None),
        speculative=_speculative(args),
        num_speculative_tokens=getattr(args, "num_speculative_tokens", 8),
        draft_model=getattr(args, "draft_model", None),
        draft_kv_cache_memory=getattr(args, "draft_kv_cache_memory", None),
        threads=None,
    )


def _speculative(args) -> str:
    """--speculative, by default draft with a --draft-model and ngram without; `complete` (no such option): off, as
    LLMEngine defaults."""
    method = getattr(args, "speculative", "none")
    if method is None:
        return "draft" if getattr(args, "draft_model", None) else "ngram"
    return method
