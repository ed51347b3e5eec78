"""One writing process per SQLite store: the single-node stores' fence.

SQLite serialises transactions, but two controllers on one database file would each plan on
its own cache and overwrite the other's decisions. The etcd store fences a stale leader with a
condition on its election key; a SQLite store has no election, so the file itself is held:
`<db>.lock`, an advisory `flock` taken when the store opens and kept until it closes. The
kernel drops it when the holder dies, however it dies (SIGKILL included), so a stale lock never
blocks a restart; the holder's pid is written into the file only to name it in the refusal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from orka.errors import Unavailable


class StoreLocked(Unavailable):
    """Another process holds the store's writer lock (another controller on the same data
    dir). Retrying helps only once that process has stopped."""


def lock_path(db: Path) -> Path:
    return db.with_name(db.name + ".lock")


def _holder(fd: int) -> str:
    """Who holds the lock, as it wrote itself down (empty if it has not yet)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(data['pid'])}"
    return "a process that has not written its pid yet"


class WriterLock:
    def __init__(self, db: Path) -> None:
        self.db = db
        self.path = lock_path(db)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Hold the store for this process, or raise StoreLocked naming the holder. Blocking
        file work: call it off the event loop."""
        if self._fd is not None:
            return
        # O_CLOEXEC: a child (an instance started by `orka up`'s agent) must not inherit it.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # Per open file: a second store on the same file in this process is refused too.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StoreLocked(
                f"store {self.db} is in use by another controller ({holder}, lock {self.path}): "
                "only one controller may use a SQLite store; stop that one, or use "
                "--store etcd://... to run several controllers"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Idempotent. The file stays: removing it could race a process that just opened it
        and would then lock an unlinked file while a third one creates a new one."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
