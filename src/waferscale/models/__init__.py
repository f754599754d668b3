"""Model code and loaders: decoder families (models/registry.py) from GGUF files or Hugging Face folders.

`model_source` and `ModelLoadError` need no PyTorch; `load_model` and `LoadedModel` import it on first use, so
that the CLI can refuse a bad model path at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waferscale.models.source import ModelLoadError, builtin_model_path, model_source

if TYPE_CHECKING:
    from waferscale.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "ModelLoadError", "builtin_model_path", "load_model", "model_source"]


def __getattr__(name: str):
    if name in ("LoadedModel", "load_model"):
        from waferscale.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
