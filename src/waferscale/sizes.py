"""Memory sizes as operators write them ('512MiB', '2GiB', '1.5GB', '1073741824'), for the CLI and the models file."""

from __future__ import annotations

import re

UNITS = {"": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9, "gib": 2**30}


def size_bytes(text: str) -> int | None:
    """Bytes from a size with an optional unit (decimal k/M/G, binary KiB/MiB/GiB); None when it is not one."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        return None
    try:
        return int(float(m.group(1)) * UNITS[m.group(2).lower()])
    except ValueError:
        return None
