"""What only the SQLite backend promises: durability, WAL, no partial commits, one writer."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from orka.errors import Conflict
from orka.store import Create, Item, Put, SqliteStore, Update
from orka.store import sqlite as sqlite_store
from orka.store.sqlite import _prefix_end
from orka.store.writer_lock import StoreLocked, lock_path


async def test_data_and_revision_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "orka.db"
    async with SqliteStore(path) as s:
        await s.commit([Create("workload", "web", {"replicas": 2}), Put("node", "n1", {})])
        await s.delete("node", "n1")
        assert await s.revision() == 2
    assert path.exists()

    async with SqliteStore(path) as s:
        assert await s.revision() == 2
        assert await s.list("workload") == [Item("workload", "web", 1, {"replicas": 2})]
        assert await s.get("node", "n1") is None
        assert await s.update("workload", "web", {"replicas": 3}, expected_revision=1) == 3


async def test_wal_and_synchronous_normal(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "orka.db") as s:
        await s.put("node", "n", {})
        pragma = s._on_writer
        assert await pragma(lambda c: c.execute("PRAGMA journal_mode").fetchall()) == [("wal",)]
        # 1 = NORMAL
        assert await pragma(lambda c: c.execute("PRAGMA synchronous").fetchall()) == [(1,)]


async def test_failure_mid_transaction_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stands in for a crash between two writes of one commit: the first write must vanish."""
    path = tmp_path / "orka.db"
    async with SqliteStore(path) as s:
        await s.create("workload", "web", {"v": 1})
        # The commit writes its creates, then its updates: the update statement fails.
        writes = list(sqlite_store._WRITES)
        writes[2] = (Update, "UPDATE no_such_table SET x = ?, y = ? WHERE a = ? AND b = ?")
        monkeypatch.setattr(sqlite_store, "_WRITES", tuple(writes))
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            await s.commit(
                [Update("workload", "web", {"v": 2}, None), Create("workload", "db", {})]
            )
        monkeypatch.undo()
        assert await s.revision() == 1
        assert await s.list("workload") == [Item("workload", "web", 1, {"v": 1})]
        assert await s.put("workload", "db", {}) == 2

    # And nothing half-written reached the file either.
    with sqlite3.connect(path) as raw:
        rows = raw.execute("SELECT kind, name, revision FROM items ORDER BY name").fetchall()
    assert rows == [("workload", "db", 2), ("workload", "web", 1)]


async def test_readers_never_see_an_uncommitted_batch(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "orka.db") as s:
        seen: set[int] = set()
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                seen.add(len(await s.list("instance")))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        for batch in range(5):
            await s.commit([Create("instance", f"{batch}-{i}", {}) for i in range(20)])
        done.set()
        await watcher
        # Only whole batches are ever visible.
        assert seen <= {0, 20, 40, 60, 80, 100}


async def test_cancelled_commit_is_rolled_back_or_complete(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "orka.db") as s:
        for delay in range(10):
            task = asyncio.create_task(
                s.commit([Put("instance", f"{delay}-{i}", {}) for i in range(50)])
            )
            for _ in range(delay):
                await asyncio.sleep(0)
            if task.cancel():
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                await task  # it had already finished: nothing left to cancel
            # Whatever point the cancel hit, the store holds whole batches and stays writable.
            rev = await s.revision()
            items = await s.list("instance")
            assert len(items) == 50 * len({i.revision for i in items})
            assert await s.put("node", "probe", {}) == rev + 1


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        ("", None),
        ("a", "b"),
        ("web-", "web."),
        ("\U0010ffff", None),
        ("a\U0010ffff", "b"),
        ("x\ud7ff", "x\ue000"),
    ],
)
def test_prefix_end(prefix: str, end: str | None) -> None:
    assert _prefix_end(prefix) == end


async def test_large_commit_checks_every_key(tmp_path: Path) -> None:
    """More keys than one precondition lookup holds: each is still checked, and one stale
    revision among them leaves all of them as they were."""
    async with SqliteStore(tmp_path / "orka.db") as s:
        names = [f"w{i:04d}" for i in range(1000)]
        await s.commit([Create("workload", n, {"v": 1}) for n in names])
        stale = [Update("workload", n, {"v": 2}, 1) for n in names]
        stale[-1] = Update("workload", names[-1], {"v": 2}, 7)
        with pytest.raises(Conflict, match="'w0999': expected revision 7, current is 1"):
            await s.commit(stale)
        assert {i.value["v"] for i in await s.list("workload")} == {1}
        await s.commit([Update("workload", n, {"v": 2}, 1) for n in names])
        items = await s.list("workload")
        assert len(items) == 1000 and {(i.revision, i.value["v"]) for i in items} == {(2, 2)}


async def test_commit_looks_keys_up_by_primary_key(tmp_path: Path) -> None:
    """A commit's precondition lookups must not scan the table: with thousands of instances
    stored, a scan per commit cost more than the rest of the commit together."""
    async with SqliteStore(tmp_path / "orka.db") as s:
        await s.commit([Create("instance", f"i{n:04d}", {}) for n in range(600)])
        await s.commit([Create("workload", "web", {})])
        statements: list[str] = []
        await s._on_writer(lambda c: c.set_trace_callback(statements.append))
        # Both kinds, and more instance names than one lookup statement holds.
        await s.commit(
            [Update("instance", f"i{n:04d}", {"v": 2}, 1) for n in range(600)]
            + [Update("workload", "web", {"v": 2}, 2), Create("workload", "db", {})]
        )
        await s._on_writer(lambda c: c.set_trace_callback(None))
        lookups = [q for q in statements if q.startswith("SELECT") and "FROM items" in q]
        assert len(lookups) >= 2

        def plans(c: sqlite3.Connection) -> list[str]:
            return [
                " / ".join(row[3] for row in c.execute(f"EXPLAIN QUERY PLAN {q}")) for q in lookups
            ]

        for plan in await s._on_writer(plans):
            assert "USING PRIMARY KEY" in plan and "SCAN items" not in plan, plan
        assert {(i.name, i.revision) for i in await s.list("workload")} == {("web", 3), ("db", 3)}


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_database_files_and_a_new_folder_are_owner_only(tmp_path: Path) -> None:
    """The store holds every spec, secret values included."""
    path = tmp_path / "data" / "orka.db"
    async with SqliteStore(path) as s:
        await s.put("workload", "web", {"secret_env": {"K": "v"}})
        files = [path, path.with_name("orka.db-wal"), path.with_name("orka.db-shm")]
        assert all(f.exists() for f in files)
        assert [_mode(f) for f in files] == [0o600, 0o600, 0o600]
    assert _mode(path.parent) == 0o700


async def test_files_left_open_by_an_older_version_are_tightened_at_open(tmp_path: Path) -> None:
    """A controller that crashed leaves a -wal and -shm with data in them, which SQLite
    reuses as they are: the open tightens all three."""
    import shutil

    live, left = tmp_path / "live", tmp_path / "left"
    left.mkdir()
    names = ["orka.db", "orka.db-wal", "orka.db-shm"]
    async with SqliteStore(live / "orka.db") as s:
        await s.put("workload", "web", {})
        for name in names:  # copied while open: what a crash leaves behind
            shutil.copy(live / name, left / name)
    files = [left / name for name in names]
    for f in files:
        f.chmod(0o644)
    assert all(f.stat().st_size > 0 for f in files)
    async with SqliteStore(left / "orka.db") as s:
        assert await s.get("workload", "web") is not None
        assert [_mode(f) for f in files] == [0o600, 0o600, 0o600]


async def test_a_second_store_on_the_file_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "orka.db"
    async with SqliteStore(path) as first:
        await first.create("workload", "web", {})
        second = SqliteStore(path)
        with pytest.raises(StoreLocked, match=rf"{path}.*in use by .*pid {os.getpid()}\b"):
            await second.open()
        # Refused before touching anything: the holder goes on, the refused one is not open.
        assert await first.create("workload", "db", {}) == 2
        with pytest.raises(RuntimeError, match="not open"):
            await second.get("workload", "web")
        await second.close()
        assert (await first.get("workload", "web")) is not None
    # Released on close: the next process (a restarted controller) opens it.
    async with SqliteStore(path) as again:
        assert [i.name for i in await again.list("workload")] == ["db", "web"]
    assert stat.S_IMODE(lock_path(path).stat().st_mode) == 0o600
