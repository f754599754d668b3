"""Durable state of the Files and Batch APIs: an SQLite database (stdlib sqlite3, WAL) in the data directory, with
uploaded and result files beside it on disk. Each batch request's result is committed on its own, with the batch's
counts, in one transaction: a crash loses only requests that were still running, and those run again."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    purpose TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, seq INTEGER NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, model TEXT,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0, result_ttl INTEGER
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, seq);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    outcome TEXT, result TEXT,
    PRIMARY KEY (batch_id, line), UNIQUE (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS requests_pending ON requests (batch_id, outcome, line);
"""

TERMINAL = ("completed", "failed", "expired", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
_TIMES = (
    "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at",
)  # fmt: skip


def new_id(prefix: str) -> str:
    """An id unique across restarts: 24 random hex digits after the prefix."""
    return prefix + secrets.token_hex(12)


@dataclass
class PendingRequest:
    line: int
    custom_id: str
    body: dict


class Store:
    """The database and the files folder. Every thread gets its own connection (WAL: readers never wait for the
    writer); writes go through one lock, so there is one writer per process."""

    def __init__(self, data_dir: str | Path):
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "waferscale.sqlite3"
        self._local = threading.local()
        self._write = threading.Lock()
        with self._write:
            self._db().executescript(SCHEMA)

    # ------------------------------------------------------------------ connections
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "PRAGMA synchronous=NORMAL"
            )  # WAL + NORMAL: a killed process loses no committed result
            self._local.db = db
        return db

    class _Tx:
        def __init__(self, store: Store):
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.store._write.acquire()
            self.db = self.store._db()
            self.db.execute("BEGIN IMMEDIATE")
            return self.db

        def __exit__(self, kind, exc, tb) -> None:
            try:
                self.db.execute("COMMIT" if kind is None else "ROLLBACK")
            finally:
                self.store._write.release()

    def _tx(self) -> Store._Tx:
        return Store._Tx(self)

    def integrity(self) -> str:
        return self._db().execute("PRAGMA integrity_check").fetchone()[0]

    # ------------------------------------------------------------------ files
    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, owner: str, filename: str, size: int, purpose: str, expires_at: int | None,
                 created_at: int | None = None, db: sqlite3.Connection | None = None) -> dict:  # fmt: skip
        row = (file_id, owner, filename, size, purpose, created_at or int(time.time()), expires_at)
        sql = "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)"
        if db is not None:
            db.execute(sql, row)
        else:
            with self._tx() as tx:
                tx.execute(sql, row)
        return self.get_file(file_id, owner, db)

    def get_file(self, file_id: str, owner: str, db: sqlite3.Connection | None = None) -> dict | None:
        row = (
            (db or self._db())
            .execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
            .fetchone()
        )
        return _file(row) if row else None

    def list_files(self, owner: str, *, after: str | None, limit: int, order: str, purpose: str | None) -> tuple[list[dict], bool]:  # fmt: skip
        """A page of the owner's files by creation (rowid breaks ties), after the file `after` in that order."""
        desc = order == "desc"
        sql = "SELECT rowid, * FROM files WHERE owner = ?"
        args: list = [owner]
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            cursor = (
                self._db()
                .execute("SELECT rowid, created_at FROM files WHERE id = ? AND owner = ?", (after, owner))
                .fetchone()
            )
            if cursor is not None:
                op = "<" if desc else ">"
                sql += f" AND (created_at, rowid) {op} (?, ?)"
                args += [cursor["created_at"], cursor["rowid"]]
        sql += f" ORDER BY created_at {'DESC' if desc else 'ASC'}, rowid {'DESC' if desc else 'ASC'} LIMIT ?"
        rows = self._db().execute(sql, [*args, limit + 1]).fetchall()
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def file_in_use(self, file_id: str) -> str | None:
        """The id of an unfinished batch that reads this file, if any."""
        row = (
            self._db()
            .execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({_marks(ACTIVE)})",
                (file_id, *ACTIVE),
            )
            .fetchone()
        )
        return row["id"] if row else None

    def delete_file(self, file_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    def expired_files(self, now: int) -> list[str]:
        rows = (
            self._db()
            .execute("SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))
            .fetchall()
        )
        return [r["id"] for r in rows]

    def orphan_paths(self, older_than: float) -> list[Path]:
        """Files on disk that no row names (an upload or a finalization cut short by a crash)."""
        known = {r["id"] for r in self._db().execute("SELECT id FROM files")}
        out = []
        for path in self.files_dir.iterdir():
            name = path.name.removesuffix(".part")
            if name not in known and path.stat().st_mtime < older_than:
                out.append(path)
        return out

    # ------------------------------------------------------------------ batches
    def add_batch(self, batch: dict) -> None:
        """A new batch row (its requests come when validation has passed)."""
        with self._tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            cols = {**batch, "seq": seq}
            db.execute(
                f"INSERT INTO batches ({', '.join(cols)}) VALUES ({_marks(cols)})", tuple(cols.values())
            )

    def add_requests(self, batch_id: str, rows: list[tuple[int, str, str]]) -> None:
        """Requests (line, custom_id, body JSON) of a batch being validated."""
        with self._tx() as db:
            db.executemany(
                "INSERT INTO requests (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                ((batch_id, line, cid, body) for line, cid, body in rows),
            )

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql += " AND owner = ?"
            args.append(owner)
        row = self._db().execute(sql, args).fetchone()
        return dict(row) if row else None

    def list_batches(self, owner: str, *, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of the owner's batches, newest first (as the SDKs page them: `after` the last one's id)."""
        sql, args = "SELECT * FROM batches WHERE owner = ?", [owner]
        if after:
            row = (
                self._db()
                .execute("SELECT seq FROM batches WHERE id = ? AND owner = ?", (after, owner))
                .fetchone()
            )
            if row is not None:
                sql += " AND seq < ?"
                args.append(row["seq"])
        rows = self._db().execute(sql + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [dict(r) for r in rows[:limit]], len(rows) > limit

    def batches_in(self, statuses: tuple[str, ...]) -> list[dict]:
        rows = (
            self._db()
            .execute(f"SELECT * FROM batches WHERE status IN ({_marks(statuses)}) ORDER BY seq", statuses)
            .fetchall()
        )
        return [dict(r) for r in rows]

    def count_active(self, owner: str) -> int:
        return (
            self._db()
            .execute(
                f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN ({_marks(ACTIVE)})",
                (owner, *ACTIVE),
            )
            .fetchone()[0]
        )

    def set_status(
        self, batch_id: str, status: str, *, only_from: tuple[str, ...] | None = None, **fields
    ) -> bool:
        """Move a batch to `status` (with timestamps or other columns); with only_from, only from those states.
        True when the row changed."""
        cols = {"status": status, **fields}
        sql = f"UPDATE batches SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?"
        args = [*cols.values(), batch_id]
        if only_from:
            sql += f" AND status IN ({_marks(only_from)})"
            args += only_from
        with self._tx() as db:
            return db.execute(sql, args).rowcount == 1

    def pending(self, batch_id: str, limit: int, skip: set[int]) -> list[PendingRequest]:
        """Requests without a result, in line order, leaving out the lines already running."""
        rows = (
            self._db()
            .execute(
                "SELECT line, custom_id, body FROM requests WHERE batch_id = ? AND outcome IS NULL ORDER BY line LIMIT ?",
                (batch_id, limit + len(skip)),
            )
            .fetchall()
        )
        out = [
            PendingRequest(r["line"], r["custom_id"], json.loads(r["body"]))
            for r in rows
            if r["line"] not in skip
        ]
        return out[:limit]

    def record(self, batch_id: str, line: int, outcome: str, result: dict, usage: dict | None = None) -> bool:
        """Commit one request's result and the batch's counts together; False (nothing written) if that request
        already has one."""
        with self._tx() as db:
            changed = db.execute(
                "UPDATE requests SET outcome = ?, result = ? WHERE batch_id = ? AND line = ? AND outcome IS NULL",
                (outcome, json.dumps(result, separators=(",", ":"), ensure_ascii=False), batch_id, line),
            ).rowcount
            if not changed:
                return False
            column = "completed" if outcome == "succeeded" else "failed"
            usage = usage or {}
            db.execute(
                f"UPDATE batches SET {column} = {column} + 1, input_tokens = input_tokens + ?, "
                "cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                (
                    usage.get("prompt_tokens", 0),
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    usage.get("completion_tokens", 0),
                    batch_id,
                ),
            )
        return True

    def close_pending(self, batch_id: str, outcome: str, make_result) -> int:
        """Give every request still without a result `outcome` (cancelled or expired), `make_result(line,
        custom_id)` as its result; counted as failed."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT line, custom_id FROM requests WHERE batch_id = ? AND outcome IS NULL", (batch_id,)
            ).fetchall()
            db.executemany(
                "UPDATE requests SET outcome = ?, result = ? WHERE batch_id = ? AND line = ?",
                (
                    (
                        outcome,
                        json.dumps(make_result(r["line"], r["custom_id"]), separators=(",", ":")),
                        batch_id,
                        r["line"],
                    )
                    for r in rows
                ),
            )
            if outcome != "cancelled":  # cancelled requests are discarded, not failures
                db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id))
        return len(rows)

    def results(self, batch_id: str, outcomes: tuple[str, ...]) -> Iterator[sqlite3.Row]:
        """The results with these outcomes, in line order, read in pages (a 50,000-line batch is never whole in
        memory)."""
        line = -1
        while True:
            rows = (
                self._db()
                .execute(
                    f"SELECT line, custom_id, outcome, result FROM requests WHERE batch_id = ? AND line > ? AND outcome IN "
                    f"({_marks(outcomes)}) ORDER BY line LIMIT 500",
                    (batch_id, line, *outcomes),
                )
                .fetchall()
            )
            if not rows:
                return
            yield from rows
            line = rows[-1]["line"]

    def finish(self, batch_id: str, status: str, files: list[dict], **fields) -> None:
        """Register the result files and move the batch to its terminal state, in one transaction."""
        with self._tx() as db:
            for f in files:
                db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", (
                    f["id"], f["owner"], f["filename"], f["bytes"], f["purpose"], f["created_at"], f["expires_at"],
                ))  # fmt: skip
            cols = {"status": status, **fields}
            db.execute(
                f"UPDATE batches SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                [*cols.values(), batch_id],
            )

    def delete_batch_results(self, batch_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))


def _marks(items) -> str:
    return ", ".join("?" * len(items))


def _file(row: sqlite3.Row) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",  # OpenAI's deprecated field, still read by older clients
        "status_details": None,
    }


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
