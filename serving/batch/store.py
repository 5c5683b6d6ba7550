"""Durable state of the Files and Batches APIs: one SQLite database under a data directory.

Files keep their bytes beside the database; batches and each of their input
lines are rows. A line's result is written in the same transaction that marks
it done, and only while it is still pending, so a runner killed at any point
resumes with exactly the lines not yet done: none lost, none twice in the
output. On KubeRay the directory is a persistent volume, so a restarted pod
resumes too.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER, expired_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    errors TEXT
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, custom_id TEXT NOT NULL,
    body TEXT NOT NULL, status TEXT NOT NULL, result TEXT,
    PRIMARY KEY (batch_id, line_index)
);
"""

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses the runner still has work in; every other status is final."""


@dataclass(frozen=True)
class StoredFile:
    """A file's metadata, as `GET /v1/files/{id}` returns it."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


@dataclass(frozen=True)
class PendingLine:
    """An input line not yet done: where it sits in the file, its id and its request body."""

    index: int
    custom_id: str
    body: str


class BatchStore:
    """Files, batches and lines; safe to call from several threads of one process."""

    def __init__(self, data_dir: Path) -> None:
        self.files_dir = data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(data_dir / "batches.sqlite3", check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._transaction() as db:
            # WAL with NORMAL sync: a commit survives the process being killed (not the
            # machine losing power) without an fsync per line.
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:
            yield self._db

    # ---- files ---------------------------------------------------------------

    def add_file(
        self, purpose: str, filename: str, content: bytes, file_id: str | None = None
    ) -> StoredFile:
        """Keep `content` under a new id, or replace `file_id` (a batch's output file,
        written again when a runner resumes finalizing). Bytes go first, so a row always
        has its bytes."""
        stored = StoredFile(
            file_id or new_id("file-"), purpose, filename, len(content), int(time.time())
        )
        self._file_path(stored.id).write_bytes(content)
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", astuple(stored))
        return stored

    def file(self, file_id: str) -> StoredFile | None:
        """The file's metadata, or None."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else StoredFile(**dict(row))

    def file_content(self, file_id: str) -> bytes:
        """The file's bytes (the caller checked it exists)."""
        return self._file_path(file_id).read_bytes()

    def delete_file(self, file_id: str) -> bool:
        """Forget the file; False if there was none."""
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if deleted:  # only ids the store made ever name a path
            self._file_path(file_id).unlink(missing_ok=True)
        return deleted

    def _file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    # ---- batches -------------------------------------------------------------

    def add_batch(
        self, input_file_id: str, endpoint: str, window: str, window_s: int, metadata: Any
    ) -> str:
        """A new batch in `validating`; returns its id."""
        batch_id = new_id("batch_")
        now = int(time.time())
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata,"
                " status, created_at, expires_at) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?)",
                (batch_id, input_file_id, endpoint, window, json.dumps(metadata), now,
                 now + window_s),
            )  # fmt: skip
        return batch_id

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's row with its line counts by status, or None."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            counts = db.execute(
                "SELECT status, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY status",
                (batch_id,),
            ).fetchall()
        return {**dict(row), "line_counts": {status: count for status, count in counts}}

    def batch_ids(self, after: str | None, limit: int) -> list[str]:
        """Ids newest first, starting past the id `after` (pagination), at most `limit`."""
        with self._transaction() as db:
            ids = [row[0] for row in db.execute("SELECT id FROM batches ORDER BY rowid DESC")]
        start = ids.index(after) + 1 if after in ids else 0
        return ids[start : start + limit]

    def active_batch_ids(self) -> list[str]:
        """Batches the runner still has work in, oldest first: the order it resumes them."""
        marks = ",".join("?" * len(ACTIVE))
        with self._transaction() as db:
            rows = db.execute(
                f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY rowid", ACTIVE
            )
            return [row[0] for row in rows]

    def set_status(
        self, batch_id: str, status: str, only_from: tuple[str, ...] = ACTIVE, **fields: Any
    ) -> bool:
        """Move the batch to `status`, stamping `<status>_at`, and set `fields`; only from
        one of `only_from` (a final status is never left). False if it was not there."""
        columns = {f"{status}_at": int(time.time()), **fields}
        assignments = ", ".join(f"{name} = ?" for name in columns)
        marks = ",".join("?" * len(only_from))
        with self._transaction() as db:
            moved = db.execute(
                f"UPDATE batches SET status = ?, {assignments}"
                f" WHERE id = ? AND status IN ({marks})",
                (status, *columns.values(), batch_id, *only_from),
            ).rowcount
        return moved > 0

    # ---- lines ---------------------------------------------------------------

    def start(self, batch_id: str, lines: list[tuple[str, str]]) -> None:
        """Store the validated lines, (custom_id, body JSON), all pending, and move the
        batch to in_progress unless it was cancelled meanwhile: one transaction, so a
        crash never leaves half of them."""
        now = int(time.time())
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
                [(batch_id, i, custom_id, body) for i, (custom_id, body) in enumerate(lines)],
            )
            db.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?"
                " WHERE id = ? AND status = 'validating'",
                (now, batch_id),
            )

    def pending_lines(self, batch_id: str) -> list[PendingLine]:
        """Every line not yet done, in input order."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT line_index, custom_id, body FROM lines"
                " WHERE batch_id = ? AND status = 'pending' ORDER BY line_index",
                (batch_id,),
            )
            return [PendingLine(*row) for row in rows]

    def finish_line(self, batch_id: str, index: int, status: str, result: dict[str, Any]) -> None:
        """Record a pending line's outcome (`completed` or `failed`) with its output record;
        a line already done keeps its first outcome."""
        with self._transaction() as db:
            db.execute(
                "UPDATE lines SET status = ?, result = ?"
                " WHERE batch_id = ? AND line_index = ? AND status = 'pending'",
                (status, json.dumps(result), batch_id, index),
            )

    def results(self, batch_id: str, status: str) -> list[dict[str, Any]]:
        """Output records of the lines that ended in `status`, in input order."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND status = ? ORDER BY line_index",
                (batch_id, status),
            )
            return [json.loads(row[0]) for row in rows]


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: the prefix, then 24 random hex digits."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"
