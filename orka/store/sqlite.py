"""Embedded durable store: one SQLite file in WAL mode.

Two connections: every commit runs on the writer inside BEGIN IMMEDIATE, and reads go to a
separate reader. With a single connection, a get() issued while a commit is between statements
would see that commit's uncommitted (and possibly rolled back) rows; WAL gives the reader the
last committed snapshot instead, without waiting for the writer.

One process at a time: open() takes the store's writer lock (writer_lock.py) and close()
gives it back, so a second controller on the same file is refused at start, naming the holder.

Reads go through aiosqlite. The writer is a plain sqlite3 connection owned by one thread of
our own, and a whole commit (BEGIN to COMMIT) runs there as one call: aiosqlite hands every
statement to its thread and back, which made a commit several round trips, and it has no
public way to run a function on its connection (placement: +10-15 % to RUNNING on SQLite).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from orka import metrics
from orka.filemodes import private_file, tighten_file
from orka.store.base import (
    Create,
    Delete,
    Item,
    Op,
    PreparedOp,
    Put,
    Require,
    Store,
    Update,
    check_precondition,
    decode_value,
    prepare_batch,
    requirements_first,
    validate_key,
    validate_kind,
    writes_nothing,
)
from orka.store.writer_lock import WriterLock

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS items (
        kind TEXT NOT NULL,
        name TEXT NOT NULL,
        revision INTEGER NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (kind, name)
    ) WITHOUT ROWID""",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta (key, value) VALUES ('revision', 0)",
)

# Another process (a second controller by mistake, the sqlite3 CLI) may hold the lock briefly;
# wait for it rather than fail at once.
_BUSY_TIMEOUT_MS = 5000


def _prefix_end(prefix: str) -> str | None:
    """The smallest string greater than every string starting with `prefix`, or None if there
    is none. Lets list() use the primary-key index as a range instead of scanning the kind.

    SQLite compares TEXT bytewise as UTF-8, which orders like code points, so incrementing the
    last code point works; surrogates are skipped because they cannot be encoded.
    """
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last == 0x10FFFF:
            continue
        nxt = 0xE000 if 0xD800 <= last + 1 <= 0xDFFF else last + 1
        return "".join(chars) + chr(nxt)
    return None


T = TypeVar("T")


class SqliteStore(Store):
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._writer: sqlite3.Connection | None = None
        self._writer_thread: ThreadPoolExecutor | None = None
        self._reader: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        self._writer_lock = WriterLock(self.path)

    async def _on_writer(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` with the writer connection on the writer's thread.

        A started call cannot be stopped, so a caller cancelled meanwhile still waits for it
        to end before it sees the cancellation: when commit() returns or raises, its batch
        has landed or not, for good (as before with aiosqlite, whose ROLLBACK was queued
        ahead of anything later)."""
        if self._writer is None or self._writer_thread is None:
            raise RuntimeError(f"store {self.path} is not open")
        writer = self._writer
        fut = asyncio.get_running_loop().run_in_executor(self._writer_thread, fn, writer)
        cancelled = False
        while not fut.done():
            try:
                await asyncio.wait([fut])  # unlike awaiting fut, a cancel here leaves it be
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            fut.exception()  # seen: whatever it raised goes with the cancellation
            raise asyncio.CancelledError
        return fut.result()

    async def open(self) -> None:
        if self._writer is not None:
            return
        # A folder made here is private; an existing one may be shared (/var/lib) and is left be.
        await asyncio.to_thread(self.path.parent.mkdir, mode=0o700, parents=True, exist_ok=True)
        # Before SQLite touches the file: a refused second controller changes nothing in it.
        await asyncio.to_thread(self._writer_lock.acquire)
        try:
            await self._connect()
        except BaseException:
            self._writer_lock.release()
            raise

    async def _connect(self) -> None:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orka-sqlite-writer")
        loop = asyncio.get_running_loop()
        try:
            writer = await loop.run_in_executor(pool, _open_writer, self.path)
        except BaseException:
            pool.shutdown(wait=False)
            raise
        try:
            reader = await aiosqlite.connect(self.path, isolation_level=None)
        except BaseException:
            await loop.run_in_executor(pool, writer.close)
            pool.shutdown(wait=False)
            raise
        try:
            await reader.execute_fetchall(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            await reader.execute("PRAGMA query_only = ON")
        except BaseException:
            await reader.close()
            await loop.run_in_executor(pool, writer.close)
            pool.shutdown(wait=False)
            raise
        self._writer, self._writer_thread, self._reader = writer, pool, reader

    async def close(self) -> None:
        # Under the lock, and on the writer's thread after whatever is queued there, so an
        # in-flight commit finishes (or rolls back) before the writer goes.
        async with self._lock:
            writer, pool, reader = self._writer, self._writer_thread, self._reader
            self._writer = self._writer_thread = self._reader = None
            if reader is not None:
                await reader.close()
            if writer is not None and pool is not None:
                await asyncio.get_running_loop().run_in_executor(pool, writer.close)
            if pool is not None:
                pool.shutdown(wait=False)
            # Last, once the writer is closed: the next holder finds the file at rest.
            self._writer_lock.release()

    def _read_conn(self) -> aiosqlite.Connection:
        if self._reader is None:
            raise RuntimeError(f"store {self.path} is not open")
        return self._reader

    async def get(self, kind: str, name: str) -> Item | None:
        validate_key(kind, name)
        rows = await self._read_conn().execute_fetchall(
            "SELECT revision, value FROM items WHERE kind = ? AND name = ?", (kind, name)
        )
        for revision, value in rows:
            return Item(kind, name, revision, decode_value(value))
        return None

    async def list(self, kind: str, prefix: str = "") -> list[Item]:
        validate_kind(kind)
        end = _prefix_end(prefix)
        if end is None:
            sql = "SELECT name, revision, value FROM items WHERE kind = ? AND name >= ?"
            params: tuple[str, ...] = (kind, prefix)
        else:
            sql = (
                "SELECT name, revision, value FROM items WHERE kind = ? AND name >= ? AND name < ?"
            )
            params = (kind, prefix, end)
        rows = await self._read_conn().execute_fetchall(sql + " ORDER BY name", params)
        return [Item(kind, name, revision, decode_value(value)) for name, revision, value in rows]

    async def revision(self) -> int:
        rows = await self._read_conn().execute_fetchall(
            "SELECT value FROM meta WHERE key = 'revision'"
        )
        return int(next(iter(rows))[0])

    async def commit(self, ops: Sequence[Op]) -> list[int]:
        prepared = prepare_batch(ops)
        if not prepared:
            return []
        # The lock keeps commits in the order they were asked for and lets close() wait.
        async with self._lock:
            with metrics.store_commit("sqlite"):
                return await self._on_writer(lambda conn: _commit(conn, prepared))


def _private(path: Path) -> None:
    """The database holds every spec, secret values included: owner-only. SQLite creates the
    -wal and -shm files with the database file's mode, so creating that 0600 before SQLite
    does covers them; ones left by an older version are tightened here."""
    private_file(path)
    for suffix in ("-wal", "-shm"):
        tighten_file(path.with_name(path.name + suffix))


def _open_writer(path: Path) -> sqlite3.Connection:
    _private(path)
    # isolation_level=None: sqlite3 must not open implicit transactions; _commit issues BEGIN
    # IMMEDIATE itself so the write lock is taken before the first precondition read.
    # Every use is on the writer's one thread (a one-worker executor keeps its thread);
    # check_same_thread is off only so that sqlite3 does not insist on it.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        # In WAL mode NORMAL is still crash-safe for the process (a killed controller loses
        # nothing it committed); only an OS crash/power loss may drop the last commits.
        conn.execute("PRAGMA synchronous = NORMAL")
        for statement in _SCHEMA:
            conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


def _commit(conn: sqlite3.Connection, prepared: list[PreparedOp]) -> list[int]:
    """One transaction on the writer's thread: check every precondition, then write, a few
    statements per commit rather than a few per op."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'revision'").fetchone()
        revision = int(row[0]) + 1
        checked = requirements_first([p.op for p in prepared if not isinstance(p.op, Put)])
        current = _revisions(conn, [(op.kind, op.name) for op in checked])
        for op in checked:
            check_precondition(op, current.get((op.kind, op.name)))
        if writes_nothing(prepared):
            conn.execute("COMMIT")
            return [0] * len(prepared)
        rows: dict[type, list[tuple[Any, ...]]] = {Delete: [], Create: [], Update: [], Put: []}
        for p in prepared:
            op = p.op
            if isinstance(op, Require):
                continue
            if isinstance(op, Delete):
                rows[Delete].append((op.kind, op.name))
            elif isinstance(op, Update):
                rows[Update].append((revision, p.encoded, op.kind, op.name))
            else:
                rows[type(op)].append((op.kind, op.name, revision, p.encoded))
        for kind, sql in _WRITES:
            if rows[kind]:
                conn.executemany(sql, rows[kind])
        conn.execute("UPDATE meta SET value = ? WHERE key = 'revision'", (revision,))
        conn.execute("COMMIT")
    except BaseException:
        # If SQLite already rolled back on its own there is no transaction left: fine.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return [0 if isinstance(p.op, Delete | Require) else revision for p in prepared]


_WRITES: tuple[tuple[type, str], ...] = (
    (Delete, "DELETE FROM items WHERE kind = ? AND name = ?"),
    (Create, "INSERT INTO items (kind, name, revision, value) VALUES (?, ?, ?, ?)"),
    (Update, "UPDATE items SET revision = ?, value = ? WHERE kind = ? AND name = ?"),
    (
        Put,
        "INSERT INTO items (kind, name, revision, value) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (kind, name) DO UPDATE "
        "SET revision = excluded.revision, value = excluded.value",
    ),
)

# Names per lookup: far below SQLite's limit on bound variables.
_LOOKUP_CHUNK = 500


def _revisions(conn: sqlite3.Connection, keys: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The current revision of each of `keys` that exists."""
    # One `kind = ? AND name IN (...)` per kind: SQLite looks that up by the primary key,
    # while a row-value `(kind, name) IN (VALUES ...)` scans the whole table (3.40).
    by_kind: dict[str, list[str]] = {}
    for kind, name in keys:
        by_kind.setdefault(kind, []).append(name)
    found: dict[tuple[str, str], int] = {}
    for kind, names in by_kind.items():
        for lo in range(0, len(names), _LOOKUP_CHUNK):
            chunk = names[lo : lo + _LOOKUP_CHUNK]
            marks = ", ".join("?" * len(chunk))
            sql = f"SELECT name, revision FROM items WHERE kind = ? AND name IN ({marks})"
            for name, rev in conn.execute(sql, [kind, *chunk]).fetchall():
                found[(kind, name)] = int(rev)
    return found
