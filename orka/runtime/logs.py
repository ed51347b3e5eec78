"""Instance log files on the node: a size bound with one rotated file, and reading them.

Every driver's instances write plain files (`Driver.log_paths`): a process's stdout and stderr
go straight to `stdout.log` / `stderr.log` (opened O_APPEND), a container's through the log
writer (`orka.runtime.logwriter`, O_APPEND too), a VM's serial console to `console.log`.

**Rotation is copytruncate, by the agent, on a timer** (`rotate`): a file past the bound is
copied to `<file>.1` (replacing the previous one) and truncated in place. The writers keep
their descriptors: a process the agent re-adopts after a restart, a shim's log writer and
libvirt's console writer all outlive the agent and none of them can be told to reopen a file,
so renaming under them would leave them writing to a file nobody reads. O_APPEND writers go on
at the new end after the truncate. The price: bytes written between the copy and the truncate
are lost (a few microseconds' worth), and a file may pass its bound by what is written in one
check interval. On disk a stream holds at most `2 * bound` plus that overshoot.

**Reading** (`follow`) starts at a `Position` (`tail_position`, `since_position`), and follows
across rotations: `<file>.1` replaced (a new inode) means the file was rotated, so the rest of
what the reader had not yet read is in `<file>.1` at the same offsets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 32 << 10
# How soon a followed file is read again after it grew (then twice as long each time it had
# not, up to follow's `poll`).
POLL_MIN = 0.01
DEFAULT_MAX_BYTES = 10 << 20
# How long a file found shorter than the reader's offset may wait for its `<file>.1` to be
# replaced before the reader takes it as truncated by someone else: `rotate` truncates first
# and replaces `<file>.1` just after, and a reader that started over at 0 in between would
# then read the rotated lines a second time from `<file>.1`.
TRUNCATE_GRACE = 1.0
# Samples of a file's size kept for `since` (one per check in which the file grew).
INDEX_SAMPLES = 4096


# The newest older file: ours (copytruncate) is `<file>.1`; a writer that rotates its own file
# by renaming it names its own (virtlogd, which writes VMs' console logs: `<file>.0`).
BACKUP = ".1"


def rotated(path: Path, backup: str = BACKUP) -> Path:
    return path.with_name(path.name + backup)


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except OSError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def rotate(path: Path, max_bytes: int) -> bool:
    """Copytruncate `path` into `<path>.1` when it holds more than `max_bytes`. Blocking."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except OSError:
        return False
    tmp = path.with_name(path.name + ".1.tmp")
    with path.open("rb") as src, open(tmp, "wb") as dst:
        os.fchmod(dst.fileno(), 0o600)
        shutil.copyfileobj(src, dst, 1 << 20)
    # Truncated first, then the rename replaces the inode readers watch (`follow`): a reader
    # that sees the new `<path>.1` reads its rest and then the file from 0, which must hold
    # only what came after the copy by then (the other way round it read the copied lines
    # twice). What the instance writes between the copy and the truncate is lost, as with
    # any copytruncate.
    os.truncate(path, 0)
    os.replace(tmp, rotated(path))
    return True


@dataclass
class SizeIndex:
    """When a file had which size: `since` starts from the last sample at or before it.
    `rotations` counts the rotations of the file, each sample says in which it was taken."""

    rotations: int = 0
    samples: deque[tuple[float, int, int]] = field(
        default_factory=lambda: deque(maxlen=INDEX_SAMPLES)
    )

    def note(self, now: float, size: int) -> None:
        if not self.samples or self.samples[-1][1:] != (size, self.rotations):
            self.samples.append((now, size, self.rotations))


@dataclass(frozen=True)
class Position:
    """Where reading starts: `offset` in `<file>.1` first when `rotated`, else in the file."""

    offset: int = 0
    rotated: bool = False
    # Without follow, read the file up to here: its size when the start was found (lines
    # written after a tail was counted are not part of it).
    end: int | None = None


def since_position(
    path: Path, since: float, index: SizeIndex | None, backup: str = BACKUP
) -> Position:
    """The first byte written at or after `since` (to the index's granularity; without
    samples, everything kept)."""
    try:
        if path.stat().st_mtime < since:
            return Position(_size(path))  # nothing newer: only what comes next
    except OSError:
        return Position()
    best: tuple[float, int, int] | None = None
    if index is not None:
        for sample in index.samples:
            if sample[0] <= since:
                best = sample
            else:
                break
    if best is None:
        try:
            whole = rotated(path, backup).stat().st_mtime >= since
        except OSError:
            whole = False
        return Position(0, rotated=whole)
    _, size, generation = best
    if index is not None and generation == index.rotations:
        return Position(size)
    if index is not None and generation == index.rotations - 1:
        return Position(size, rotated=True)
    return Position(0, rotated=True)


def tail_position(path: Path, lines: int, backup: str = BACKUP) -> Position:
    """The start of the last `lines` lines kept (in the file, else in `<file>.1`), and the
    file's size they were counted up to (`end`). Blocking; reads backwards in blocks, at most
    the files' bounded size."""
    size = _size(path)
    return dataclasses.replace(_tail_position(path, lines, backup, size), end=size)


def _tail_position(path: Path, lines: int, backup: str, size: int) -> Position:
    if lines <= 0:
        return Position(0, rotated=True)
    need = lines
    current = size > 0
    for is_rotated, p in ((False, path), (True, rotated(path, backup))):
        try:
            f = p.open("rb")
        except OSError:
            continue
        with f:
            end = os.fstat(f.fileno()).st_size
            if not is_rotated:
                end = min(end, size)  # what the instance writes meanwhile is not counted
            pos = end
            first = True
            while pos > 0:
                step = min(64 << 10, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step)
                if first and block.endswith(b"\n"):
                    # The last line's own newline does not start another line.
                    block = block[:-1]
                elif first and is_rotated and current:
                    # A line cut by the rotation continues in the file: already counted.
                    need += 1
                first = False
                at = len(block)
                while True:
                    at = block.rfind(b"\n", 0, at)
                    if at < 0:
                        break
                    need -= 1
                    if need == 0:
                        return Position(pos + at + 1, rotated=is_rotated)
        if not is_rotated and need > 0 and _size(path) > 0:
            need -= 1  # the file's first line (no newline before it)
            if need == 0:
                return _line_start(path, backup)
    return Position(0, rotated=True)


def _line_start(path: Path, backup: str) -> Position:
    """Where the file's first line starts: in `<file>.1` when the rotation cut it."""
    old = rotated(path, backup)
    try:
        with old.open("rb") as f:
            end = os.fstat(f.fileno()).st_size
            f.seek(max(0, end - (64 << 10)))
            block = f.read()
    except OSError:
        return Position(0)
    if not block or block.endswith(b"\n"):
        return Position(0)
    at = block.rfind(b"\n")
    return Position(end - len(block) + at + 1, rotated=True)


def _read_at(path: Path, offset: int, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(limit)
    except OSError:
        return b""


async def follow(
    path: Path,
    start: Position,
    follow: bool,
    poll: float = 0.2,
    chunk: int = CHUNK,
    backup: str = BACKUP,
    renamed: bool = False,
) -> AsyncIterator[bytes]:
    """The file's bytes from `start`, in chunks of at most `chunk`; with `follow`, then what
    is written next, across rotations, until cancelled. `renamed`: the writer rotates by
    renaming the file to `<file><backup>` and starting a new one (virtlogd), not by
    copytruncate."""
    old = rotated(path, backup)
    offset = start.offset
    if start.rotated:
        while data := await asyncio.to_thread(_read_at, old, offset, chunk):
            offset += len(data)
            yield data
        offset = 0
    seen = _inode(path if renamed else old)
    # Without follow: what the file held when reading began, not what comes while it is read
    # (a tail of 3 lines is 3 lines, however fast the instance writes).
    end = None if follow else (start.end if start.end is not None else _size(path))
    wait = POLL_MIN
    loop = asyncio.get_running_loop()
    shorter_since: float | None = None
    while True:
        # Checked before each read: the file may have grown past our offset again since the
        # rotation, and reading on there would skip what was written between.
        inode = _inode(path if renamed else old)
        if renamed and not seen:
            seen = inode  # the file appeared
        elif inode != seen:
            # Rotated since: the rest of what was not read is in `<file>.1`.
            seen = inode
            shorter_since = None
            while data := await asyncio.to_thread(_read_at, old, offset, chunk):
                offset += len(data)
                yield data
            offset = 0
            if end is not None:
                return  # what there was when reading began is all read
        limit = chunk if end is None else min(chunk, end - offset)
        if limit <= 0:
            return
        data = await asyncio.to_thread(_read_at, path, offset, limit)
        if data:
            offset += len(data)
            wait = POLL_MIN
            yield data
            continue
        if not follow:
            return
        if _size(path) >= offset:
            shorter_since = None
        elif shorter_since is None:
            shorter_since = loop.time()  # a rotation half done, or a truncation
        elif loop.time() - shorter_since >= TRUNCATE_GRACE:
            offset, shorter_since = 0, None  # truncated by someone else
        # A file being written is looked at again soon, an idle one less and less often
        # (up to `poll`): a follow costs little when nothing happens, and lags little when
        # something does.
        await asyncio.sleep(wait)
        wait = min(wait * 2, poll)
