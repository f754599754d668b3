"""API keys with names and limits: `--api-keys-file` (TOML) and `--api-key`. Only SHA-256 digests are kept; a key
is known by its name in logs and metrics, never by itself."""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from waferscale.api.limits import Limits

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
FLAG_KEY_NAME = "api-key-{}"  # names of --api-key / WAFERSCALE_API_KEY keys, in the order given


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the entry and what to change."""


@dataclass(frozen=True)
class KeySpec:
    """One key: its name, the SHA-256 digest of the key, and its limits."""

    name: str
    digest: bytes
    limits: Limits


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def flag_keys(keys: list[str]) -> list[KeySpec]:
    """Keys from --api-key / WAFERSCALE_API_KEY: named api-key-1, api-key-2..., without limits."""
    return [KeySpec(FLAG_KEY_NAME.format(i), digest(k), Limits()) for i, k in enumerate(keys, 1)]


def load_key_file(path: str | Path) -> list[KeySpec]:
    """The `[keys.NAME]` tables of a TOML file: `key` or `key_sha256`, and optional limits (see Limits)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the key file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"{path}: not valid TOML ({exc})") from None
    extra = set(doc) - {"keys"}
    if extra:
        raise KeyFileError(f"{path}: unknown top-level entries {sorted(extra)}; keys go in [keys.NAME] tables")
    tables = doc.get("keys", {})
    if not isinstance(tables, dict):
        raise KeyFileError(f"{path}: 'keys' must be tables, e.g. [keys.alice]")
    specs = [_spec(path, name, entry) for name, entry in tables.items()]
    return check_unique(specs, str(path))


def _spec(path, name: str, entry) -> KeySpec:
    where = f"{path}: [keys.{name}]"
    if not NAME.match(name):
        raise KeyFileError(f"{where}: a name is 1-64 letters, digits, '.', '_' or '-' (it appears in metrics)")
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: must be a table with key or key_sha256")
    unknown = set(entry) - {"key", "key_sha256", *Limits.names()}
    if unknown:
        raise KeyFileError(
            f"{where}: unknown fields {sorted(unknown)}; allowed: key, key_sha256, {', '.join(Limits.names())}"
        )
    if ("key" in entry) == ("key_sha256" in entry):
        raise KeyFileError(f"{where}: give exactly one of key or key_sha256")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or not key or key != key.strip() or "," in key:
            raise KeyFileError(f"{where}: key must be a non-empty string without spaces or commas")
        dig = digest(key)
    else:
        hexed = entry["key_sha256"]
        if not isinstance(hexed, str) or not HEX64.match(hexed):
            raise KeyFileError(f"{where}: key_sha256 must be 64 hex digits (sha256sum of the key)")
        dig = bytes.fromhex(hexed)
    limits = {}
    for field in Limits.names():
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KeyFileError(f"{where}: {field} must be a positive integer (leave it out for no limit)")
        limits[field] = value
    return KeySpec(name, dig, Limits(**limits))


def check_unique(specs: list[KeySpec], source: str) -> list[KeySpec]:
    """The specs, unless two share a name or a key."""
    names: set[str] = set()
    digests: dict[bytes, str] = {}
    for s in specs:
        if s.name in names:
            raise KeyFileError(f"{source}: the name {s.name!r} is used twice")
        if s.digest in digests:
            raise KeyFileError(f"{source}: {digests[s.digest]!r} and {s.name!r} have the same key")
        names.add(s.name)
        digests[s.digest] = s.name
    return specs
