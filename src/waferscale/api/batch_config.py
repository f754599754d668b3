"""The Files and Batch APIs' settings: where their state lives and the limits (the hosted service's, by default)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DAY = 86_400


def default_data_dir() -> Path:
    """$WAFERSCALE_DATA_DIR, else $XDG_DATA_HOME/waferscale, else ~/.local/share/waferscale."""
    if os.environ.get("WAFERSCALE_DATA_DIR"):
        return Path(os.environ["WAFERSCALE_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "waferscale"


@dataclass
class BatchSettings:
    data_dir: Path | None = None  # None: default_data_dir()
    max_upload_bytes: int = 200 << 20  # the hosted 200 MB, read as MiB so that a 200 MB file always fits
    min_requests: int = 10
    max_requests: int = 50_000
    max_line_bytes: int = 1 << 20
    max_active_batches: int = 10  # per key: validating, in progress, finalizing or cancelling
    concurrency: int = 64  # batch requests in flight on the engine at once
    file_ttl: int = 7 * DAY  # uploaded files, unless expires_after says otherwise
    result_ttl: int = 7 * DAY  # output and error files, after the batch ends
    window: int = DAY  # completion_window "24h"
    sweep_interval: float = 60.0  # seconds between expiry sweeps

    def directory(self) -> Path:
        return Path(self.data_dir) if self.data_dir is not None else default_data_dir()
