"""Durable timers in SQLite (WAL, fsync on commit), written by one thread with group commit.

Changes queue up while a transaction is being written; the next transaction takes all of them, so
one fsync covers every request that arrived in the meantime. ``sqlite3`` errors become ``StorageError``
here. A lock file keeps two nodes from sharing one data directory.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..timers import Timer

__all__ = ["SqliteStorage"]

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS timers (
    id TEXT PRIMARY KEY,
    due_ms INTEGER NOT NULL,
    deadline_ms INTEGER NOT NULL,
    timeout_ms INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    spec BLOB NOT NULL
) WITHOUT ROWID
"""
_COLUMNS = "due_ms, id, deadline_ms, timeout_ms, attempts, spec"  # the order of Timer's fields
_UPSERT = f"INSERT OR REPLACE INTO timers ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)"
_DELETE = "DELETE FROM timers WHERE id = ?"
_SELECT = f"SELECT {_COLUMNS} FROM timers"

_PUT, _DEL = 0, 1
_SWITCH_INTERVAL_S = 0.0005
_Op = tuple[int, tuple[Any, ...]]


class SqliteStorage:
    name = "sqlite"

    def __init__(self, path: Path, conn: sqlite3.Connection, lock_fd: int, executor: ThreadPoolExecutor) -> None:
        self._path = path
        self._conn = conn
        self._lock_fd = lock_fd
        self._executor = executor
        self._queued: list[_Op] = []
        self._queued_done: asyncio.Future[None] | None = None
        self._writing: asyncio.Future[None] | None = None
        self._commits = 0
        self._last_error: str | None = None

    @classmethod
    async def open(cls, data_dir: str) -> SqliteStorage:
        """Open (creating if needed) ``<data_dir>/timers.db``.

        Raises:
            StorageError: the directory cannot be used, or another node holds it.
        """
        directory = Path(data_dir)
        # The writer thread waits for the GIL whenever the busy event loop holds it, 5 ms at a time by
        # default; a shorter switch interval let it commit ~25 % more creates/s (docs/benchmarks.md).
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyring-sqlite")
        try:
            conn, lock_fd = await asyncio.get_running_loop().run_in_executor(executor, _connect, directory)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(directory / "timers.db", conn, lock_fd, executor)

    def put(self, timer: Timer) -> asyncio.Future[None]:
        return self._enqueue((_PUT, tuple(timer)))

    def delete(self, timer_id: str) -> asyncio.Future[None]:
        return self._enqueue((_DEL, (timer_id,)))

    def _enqueue(self, op: _Op) -> asyncio.Future[None]:
        self._queued.append(op)
        if self._queued_done is None:
            self._queued_done = asyncio.get_running_loop().create_future()
        done = self._queued_done
        if self._writing is None:
            self._write_queued()
        # Every caller of one group commit shares ``done``: a caller that is cancelled must not cancel it.
        return asyncio.shield(done)

    def _write_queued(self) -> None:
        ops, done = self._queued, self._queued_done
        assert done is not None
        self._queued, self._queued_done = [], None
        loop = asyncio.get_running_loop()
        self._writing = loop.run_in_executor(self._executor, self._write, ops)
        self._writing.add_done_callback(lambda written: self._written(written, done))

    def _written(self, written: asyncio.Future[None], done: asyncio.Future[None]) -> None:
        self._writing = None
        try:
            exc = written.exception()
            if exc is None:
                self._commits += 1
                done.set_result(None)
            else:
                self._last_error = str(exc)
                logger.error("storage write failed path=%s error=%s", self._path, exc)
                done.set_exception(StorageError(f"storage write failed: {exc}"))
                done.exception()  # retrieved here: callers that stopped waiting must not warn
        finally:
            if self._queued:
                self._write_queued()

    def _write(self, ops: list[_Op]) -> None:
        conn = self._conn
        conn.execute("BEGIN")
        try:
            for kind, group in itertools.groupby(ops, key=lambda op: op[0]):
                conn.executemany(_UPSERT if kind == _PUT else _DELETE, [args for _, args in group])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    async def load(self) -> list[Timer]:
        def read() -> list[Timer]:
            return [Timer(*row) for row in self._conn.execute(_SELECT)]

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, read)
        except sqlite3.Error as exc:
            raise StorageError(f"cannot read {self._path}: {exc}") from exc

    async def close(self) -> None:
        while self._writing is not None or self._queued:
            if self._writing is None:
                self._write_queued()
            assert self._writing is not None
            await asyncio.wait([self._writing])
        await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=True)
        os.close(self._lock_fd)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "durable": True,
            "path": str(self._path),
            "status": "ok" if self._last_error is None else "error",
            "last_error": self._last_error,
            "commits": self._commits,
        }


def _connect(directory: Path) -> tuple[sqlite3.Connection, int]:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot use data directory {directory}: {exc}") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        raise StorageError(f"data directory {directory} is in use by another skyring process") from None
    try:
        conn = sqlite3.connect(directory / "timers.db", isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # fsync each commit: a 201 survives power loss
        conn.execute(_SCHEMA)
    except sqlite3.Error as exc:
        os.close(lock_fd)
        raise StorageError(f"cannot open {directory / 'timers.db'}: {exc}") from exc
    return conn, lock_fd
