"""A server process on loopback for the benchmark and soak scripts: start, wait until healthy, read its memory, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def proc_status(pid: int, key: str) -> int | None:
    """A kB figure (VmRSS, VmHWM) from /proc/PID/status, in bytes; None where unreadable."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def served(
    argv: list[str], log: Path, label: str, timeout: float = 900, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `argv --host 127.0.0.1 --port P` (output to `log`, with `env` added to this process's environment),
    wait until /health answers 200, yield its URL and process, then stop it."""
    import httpx

    port = free_port()
    argv = [*argv, "--host", HOST, "--port", str(port)]
    print(f"starting {label}: {' '.join(argv)}", file=sys.stderr)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
        )
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited ({proc.returncode}) before it was healthy:\n{tail(log)}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} not healthy after {timeout:g} s:\n{tail(log)}")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
