"""`waferscale serve --models FILE`: the models one server serves, read from TOML (docs/models.md). Each
`[[model]]` table is a name (and aliases), a path and that model's own engine options; options it leaves out take
the command line's values. Mistakes are refused at start with the line that caused them."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from waferscale.api.models_registry import ModelSpec
from waferscale.engine.settings import EngineSettings, SettingsError
from waferscale.models.source import BUILTIN_MODELS
from waferscale.sizes import size_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli package (a dependency there)
    import tomli as tomllib

# option in the file -> EngineSettings field (None: a ModelSpec field)
OPTIONS: dict[str, str | None] = {
    "name": None,
    "aliases": None,
    "pinned": None,
    "path": "model",
    "dtype": "dtype",
    "quantization": "quantization",
    "max_model_len": "max_model_len",
    "kv_cache_memory": "kv_cache_memory",
    "kv_cache_dtype": "kv_cache_dtype",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "prefix_cache": "enable_prefix_cache",
    "speculative": "speculative",
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_model": "draft_model",
    "draft_kv_cache_memory": "draft_kv_cache_memory",
}
TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "aliases": (list,),
    "pinned": (bool,),
    "path": (str,),
    "dtype": (str,),
    "quantization": (str,),
    "max_model_len": (int,),
    "kv_cache_memory": (int, str),
    "kv_cache_dtype": (str,),
    "max_num_seqs": (int,),
    "max_num_batched_tokens": (int,),
    "prefix_cache": (bool,),
    "speculative": (str,),
    "num_speculative_tokens": (int,),
    "draft_model": (str,),
    "draft_kv_cache_memory": (int, str),
}


KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "a list"}


class ModelsFileError(ValueError):
    """A models file the server cannot start from; the message names the file, the line and what to change."""


def read_models_file(path: str | Path, defaults: EngineSettings) -> list[ModelSpec]:
    """The models `path` configures, each on `defaults` (the command line's engine options) where it says nothing.
    Raises ModelsFileError."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ModelsFileError(f"cannot read the models file {path}: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ModelsFileError(f"{path}: not valid TOML: {exc}") from None
    unknown = [k for k in doc if k != "model"]
    if unknown:
        raise ModelsFileError(
            f"{path}:{_line(text, None, unknown[0])}: unknown table or option {unknown[0]!r}; the file holds "
            "[[model]] tables only"
        )
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise ModelsFileError(
            f"{path}: no [[model]] table; each model served is one [[model]] with name and path"
        )
    specs: list[ModelSpec] = []
    owner: dict[str, str] = {}
    for i, table in enumerate(tables):
        spec = _spec(path, text, i, table, defaults)
        for name in spec.names:
            if name in owner:
                raise ModelsFileError(
                    f"{path}:{_line(text, i, 'name' if name == spec.name else 'aliases')}: duplicate model name "
                    f"{name!r} (already the name or an alias of {owner[name]!r}); each name picks one model"
                )
            owner[name] = spec.name
        specs.append(spec)
    return specs


def _spec(path: Path, text: str, i: int, table: dict, defaults: EngineSettings) -> ModelSpec:
    def fail(key: str | None, message: str) -> ModelsFileError:
        return ModelsFileError(f"{path}:{_line(text, i, key)}: {message}")

    for key, value in table.items():
        if key.replace("-", "_") not in OPTIONS:
            raise fail(key, f"unknown option {key!r} in [[model]] (options: {', '.join(OPTIONS)})")
        if not isinstance(value, TYPES[key.replace("-", "_")]) or (
            isinstance(value, bool) and bool not in TYPES[key.replace("-", "_")]
        ):
            kinds = " or ".join(KIND_NAMES[t] for t in TYPES[key.replace("-", "_")])
            raise fail(key, f"{key} = {value!r} is not {kinds}")
    table = {k.replace("-", "_"): v for k, v in table.items()}
    if "name" not in table:
        raise fail(None, "[[model]] has no name (the name clients send as `model`)")
    if "path" not in table:
        raise fail(
            None,
            f"model {table['name']!r} has no path (a GGUF file, a Hugging Face folder or a built-in name)",
        )
    aliases = table.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise fail("aliases", 'aliases is a list of names, e.g. aliases = ["llama3.1-8b"]')
    changes: dict[str, object] = {}
    for key, value in table.items():
        field = OPTIONS[key]
        if field is None:
            continue
        if key in ("kv_cache_memory", "draft_kv_cache_memory") and isinstance(value, str):
            value = size_bytes(value)
            if value is None:
                raise fail(key, f"{key} = {table[key]!r} is not a size (examples: 256MiB, 2GiB)")
        if key in ("path", "draft_model") and not value.startswith("self:"):
            # relative to the file's folder, unless a built-in name
            where = path.parent / Path(value).expanduser()
            value = value if value in BUILTIN_MODELS and not where.exists() else str(where.resolve())
        changes[field] = value
    if "draft_model" in table and "speculative" not in table:
        changes["speculative"] = "draft"  # as --draft-model makes it the default
    try:
        settings = dataclasses.replace(defaults, **changes)
    except SettingsError as exc:
        raise fail(None, f"model {table['name']!r}: {exc}") from None
    return ModelSpec(table["name"], settings, tuple(aliases), bool(table.get("pinned", False)))


def _line(text: str, index: int | None, key: str | None) -> int:
    """The line number of `key` in the index-th [[model]] table (its header when `key` is None or not found), or
    of a top-level `key` when `index` is None."""
    lines = text.splitlines()
    headers = [n for n, line in enumerate(lines) if re.match(r"\s*\[\[\s*model\s*\]\]", line)]
    if index is None:
        start, end = 0, headers[0] if headers else len(lines)
    else:
        start = headers[index] if index < len(headers) else 0
        end = headers[index + 1] if index + 1 < len(headers) else len(lines)
    if key is not None:
        pattern = re.compile(rf"\s*\[*\s*\"?{re.escape(key)}\"?\s*[=\]]")
        for n in range(start, end):
            if pattern.match(lines[n]):
                return n + 1
    return start + 1
