"""Model code and loaders: Llama-family transformers from GGUF files or Hugging Face folders."""

from waferscale.models.loader import LoadedModel, ModelLoadError, builtin_model_path, load_model

__all__ = ["LoadedModel", "ModelLoadError", "builtin_model_path", "load_model"]
