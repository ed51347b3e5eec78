"""Embedded durable store: one SQLite file in WAL mode, driven through aiosqlite.

Two connections: every commit runs on the writer inside BEGIN IMMEDIATE, and reads go to a
separate reader. With a single connection, a get() issued while a commit is between statements
would see that commit's uncommitted (and possibly rolled back) rows; WAL gives the reader the
last committed snapshot instead, without waiting for the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from orka.store.base import (
    Create,
    Delete,
    Item,
    Op,
    PreparedOp,
    Put,
    Store,
    Update,
    check_precondition,
    decode_value,
    prepare_batch,
    validate_key,
    validate_kind,
)

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


class SqliteStore(Store):
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        if self._writer is not None:
            return
        await asyncio.to_thread(self.path.parent.mkdir, parents=True, exist_ok=True)
        # isolation_level=None: sqlite3 must not open implicit transactions; commit() issues
        # BEGIN IMMEDIATE itself so the write lock is taken before the first precondition read.
        writer = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            await writer.execute_fetchall(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            await writer.execute_fetchall("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL is still crash-safe for the process (a killed controller loses
            # nothing it committed); only an OS crash/power loss may drop the last commits.
            await writer.execute("PRAGMA synchronous = NORMAL")
            for statement in _SCHEMA:
                await writer.execute(statement)
            reader = await aiosqlite.connect(self.path, isolation_level=None)
        except BaseException:
            await writer.close()
            raise
        try:
            await reader.execute_fetchall(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            await reader.execute("PRAGMA query_only = ON")
        except BaseException:
            await reader.close()
            await writer.close()
            raise
        self._writer, self._reader = writer, reader

    async def close(self) -> None:
        # Under the lock so an in-flight commit finishes (or rolls back) before the writer goes.
        async with self._lock:
            writer, reader = self._writer, self._reader
            self._writer = self._reader = None
            if reader is not None:
                await reader.close()
            if writer is not None:
                await writer.close()

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
        # One writer connection means one transaction at a time; the lock queues commits in the
        # event loop instead of letting a second BEGIN fail on the same connection.
        async with self._lock:
            if self._writer is None:
                raise RuntimeError(f"store {self.path} is not open")
            db = self._writer
            try:
                # Inside the try: a cancel while BEGIN is queued still lets BEGIN run on the
                # connection's thread, and the transaction must then be rolled back.
                await db.execute("BEGIN IMMEDIATE")
                rows = await db.execute_fetchall("SELECT value FROM meta WHERE key = 'revision'")
                revision = int(next(iter(rows))[0]) + 1
                results = await self._apply(db, prepared, revision)
                await db.execute("UPDATE meta SET value = ? WHERE key = 'revision'", (revision,))
                await db.execute("COMMIT")
            except BaseException:
                # Shielded so a cancelled caller still ends the transaction; statements run in
                # order on the connection's thread, so ROLLBACK lands before any later BEGIN.
                await asyncio.shield(self._rollback(db))
                raise
            return results

    async def _apply(
        self, db: aiosqlite.Connection, prepared: list[PreparedOp], revision: int
    ) -> list[int]:
        """Check every precondition, then write: a few statements per commit rather than a
        few per op, since each statement is a round trip to the connection's thread."""
        checked = [p.op for p in prepared if not isinstance(p.op, Put)]
        current = await _revisions(db, [(op.kind, op.name) for op in checked])
        for op in checked:
            check_precondition(op, current.get((op.kind, op.name)))
        rows: dict[type, list[tuple[Any, ...]]] = {Delete: [], Create: [], Update: [], Put: []}
        for p in prepared:
            op = p.op
            if isinstance(op, Delete):
                rows[Delete].append((op.kind, op.name))
            elif isinstance(op, Update):
                rows[Update].append((revision, p.encoded, op.kind, op.name))
            else:
                rows[type(op)].append((op.kind, op.name, revision, p.encoded))
        for kind, sql in _WRITES:
            if rows[kind]:
                await db.executemany(sql, rows[kind])
        return [0 if isinstance(p.op, Delete) else revision for p in prepared]

    @staticmethod
    async def _rollback(db: aiosqlite.Connection) -> None:
        # If BEGIN never took, COMMIT already went through (the caller was cancelled while it ran;
        # the caller then sees CancelledError for a write that landed, as with any remote store),
        # or SQLite rolled back on its own, there is no transaction and ROLLBACK says so: fine.
        with contextlib.suppress(sqlite3.OperationalError):
            await db.execute("ROLLBACK")


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

# Keys per lookup: two bound variables each, far below SQLite's limit on variables.
_LOOKUP_CHUNK = 400


async def _revisions(
    db: aiosqlite.Connection, keys: list[tuple[str, str]]
) -> dict[tuple[str, str], int]:
    """The current revision of each of `keys` that exists."""
    found: dict[tuple[str, str], int] = {}
    for lo in range(0, len(keys), _LOOKUP_CHUNK):
        chunk = keys[lo : lo + _LOOKUP_CHUNK]
        values = ", ".join("(?, ?)" for _ in chunk)
        sql = f"SELECT kind, name, revision FROM items WHERE (kind, name) IN (VALUES {values})"
        params = [part for key in chunk for part in key]
        for kind, name, rev in await db.execute_fetchall(sql, params):
            found[(kind, name)] = int(rev)
    return found
