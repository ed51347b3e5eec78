"""Instance log files: rotation, where --tail and --since start, following across rotations."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from orka.runtime.logs import Position, SizeIndex, follow, rotate, since_position, tail_position


def write(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def lines_from(path: Path, start: Position) -> bytes:
    old = path.with_name(path.name + ".1")
    head = old.read_bytes()[start.offset :] if start.rotated and old.exists() else b""
    return head + path.read_bytes()[0 if start.rotated else start.offset :]


@pytest.mark.parametrize(
    ("current", "rotated", "n", "expected"),
    [
        (b"a\nb\nc\n", None, 2, b"b\nc\n"),
        (b"a\nb\nc", None, 2, b"b\nc"),  # a last line without its newline counts
        (b"a\nb\nc\n", None, 3, b"a\nb\nc\n"),
        (b"a\nb\nc\n", None, 10, b"a\nb\nc\n"),
        (b"c\n", b"a\nb\n", 2, b"b\nc\n"),  # reaches into the rotated file
        (b"tial\nc\n", b"a\nb\npar", 3, b"b\npartial\nc\n"),  # a line cut by the rotation
        (b"tial\nc\n", b"a\nb\npar", 2, b"partial\nc\n"),
        (b"", b"a\nb\n", 1, b"b\n"),  # just rotated
        (b"", None, 5, b""),
    ],
)
def test_tail_position(
    tmp_path: Path, current: bytes, rotated: bytes | None, n: int, expected: bytes
) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(current)
    if rotated is not None:
        (tmp_path / "stdout.log.1").write_bytes(rotated)
    assert lines_from(path, tail_position(path, n)) == expected


def test_tail_position_reads_backwards_across_blocks(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"".join(b"line %d %s\n" % (i, b"x" * 200) for i in range(2000)))
    assert lines_from(path, tail_position(path, 3)).splitlines()[0].startswith(b"line 1997 ")


async def test_a_tail_is_the_lines_counted_not_what_is_written_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"a\nb\nc\nd\n")
    start = tail_position(path, 3)
    assert start == Position(2, end=8)
    write(path, b"e\n")  # the instance writes on while the tail is sent
    got = b"".join([chunk async for chunk in follow(path, start, follow=False)])
    assert got == b"b\nc\nd\n"


def test_rotate_truncates_before_the_old_file_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A follower takes a new `.1` as "rotated: read its rest, then the file from 0"; were the
    # file not yet truncated then, it would read the copied lines twice (CI saw it).
    path = tmp_path / "stdout.log"
    path.write_bytes(b"line\n" * 100)
    sizes: list[int] = []
    real = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        sizes.append(path.stat().st_size)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert rotate(path, 100)
    assert sizes == [0]
    assert (tmp_path / "stdout.log.1").read_bytes() == b"line\n" * 100


def test_rotate_keeps_one_old_file_and_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"x" * 100)
    assert not rotate(path, 100)  # at the bound: kept
    write(path, b"y")
    assert rotate(path, 100)
    assert (
        path.read_bytes() == b"" and (tmp_path / "stdout.log.1").read_bytes() == b"x" * 100 + b"y"
    )
    write(path, b"z" * 150)
    assert rotate(path, 100)
    assert (tmp_path / "stdout.log.1").read_bytes() == b"z" * 150  # the older one is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stdout.log", "stdout.log.1"]
    assert not rotate(tmp_path / "missing.log", 1)


def test_since_position_uses_the_size_index(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"old\n")
    index = SizeIndex()
    index.note(100.0, 4)
    write(path, b"new\n")
    index.note(200.0, 8)
    assert since_position(path, 150.0, index) == Position(4)
    assert since_position(path, 250.0, index) == Position(8)
    assert since_position(path, 50.0, index) == Position(0)  # before the index: all
    # A sample taken before the last rotation points into the rotated file.
    index.rotations += 1
    assert since_position(path, 150.0, index) == Position(4, rotated=True)
    # A file not written since then: only what comes next.
    assert since_position(path, 1e12, index) == Position(8)


async def test_follow_reads_on_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    path.write_bytes(b"one\n")
    reader = follow(path, Position(0), follow=True, poll=0.01)
    async with asyncio.timeout(5):
        assert await anext(reader) == b"one\n"
        write(path, b"two\n")
        rotate(path, 1)  # copied and truncated before the reader saw "two"
        write(path, b"three\n")
        got = b""
        while got != b"two\nthree\n":
            got += await anext(reader)
    await reader.aclose()


async def test_follow_waits_out_a_rotation_caught_between_truncate_and_replace(
    tmp_path: Path,
) -> None:
    # `rotate` truncates, then replaces `.1`: a reader polling in between sees a file shorter
    # than its offset and must not start over at 0, or it reads the copied lines twice from
    # the new `.1` (CI saw lines 1-173 twice).
    path = tmp_path / "stdout.log"
    path.write_bytes(b"one\n")
    reader = follow(path, Position(0), follow=True, poll=0.01)
    async with asyncio.timeout(5):
        assert await anext(reader) == b"one\n"
        pending = asyncio.ensure_future(anext(reader))
        write(path, b"two\n")
        copied = path.read_bytes()
        os.truncate(path, 0)
        await asyncio.sleep(0.2)  # the reader polls the short file some 10 times
        assert not pending.done()
        (tmp_path / "stdout.log.1").write_bytes(copied)
        write(path, b"three\n")
        got = await pending
        while got != b"two\nthree\n":
            assert len(got) < len(b"two\nthree\n"), got
            got += await anext(reader)
    await reader.aclose()


async def test_follow_starts_over_after_a_truncation_by_someone_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("orka.runtime.logs.TRUNCATE_GRACE", 0.05)
    path = tmp_path / "stdout.log"
    path.write_bytes(b"one\ntwo\n")
    reader = follow(path, Position(0), follow=True, poll=0.01)
    async with asyncio.timeout(5):
        assert await anext(reader) == b"one\ntwo\n"
        os.truncate(path, 0)
        pending = asyncio.ensure_future(anext(reader))
        await asyncio.sleep(0.2)  # past the grace: the reader is at 0 now
        write(path, b"new\n")
        assert await pending == b"new\n"
    await reader.aclose()


async def test_follow_without_follow_ends_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "stdout.log"
    (tmp_path / "stdout.log.1").write_bytes(b"a\n")
    path.write_bytes(b"b\n" * 20_000)
    chunks = [c async for c in follow(path, Position(0, rotated=True), follow=False)]
    assert b"".join(chunks) == b"a\n" + b"b\n" * 20_000
    assert max(len(c) for c in chunks) <= 32 << 10


async def test_follow_a_writer_that_rotates_by_renaming(tmp_path: Path) -> None:
    """virtlogd's way (VM console logs): the full file becomes `<file>.0`, a new one starts."""
    path = tmp_path / "console.log"
    path.write_bytes(b"one\n")
    reader = follow(path, Position(0), follow=True, poll=0.01, backup=".0", renamed=True)
    async with asyncio.timeout(5):
        assert await anext(reader) == b"one\n"
        write(path, b"two\n")
        path.rename(tmp_path / "console.log.0")
        path.write_bytes(b"three\nfour\n")  # already past the old offset
        got = b""
        while got != b"two\nthree\nfour\n":
            got += await anext(reader)
    await reader.aclose()
    assert tail_position(path, 3, ".0") == Position(4, rotated=True, end=11)
