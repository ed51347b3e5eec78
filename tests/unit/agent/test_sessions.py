"""Agent sessions: output paced by credit, cancel and disconnect end them quietly."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import code_pb2

from orka.agent.logs import LogKeeper
from orka.agent.sessions import Session, Sessions
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.runtime import logs as logfiles
from orka.runtime.logs import SizeIndex


def two_streams(
    tmp_path: Path, out_data: bytes, err_data: bytes, **driver_fields: object
) -> tuple[Sessions, list[apb.AgentMessage], SimpleNamespace]:
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_bytes(out_data)
    err.write_bytes(err_data)

    def log_paths(name: str) -> tuple[Path, Path]:
        # The instance's own files, so a session asking for another's reads nothing.
        return (out, err) if name == "web-1" else (tmp_path / "other.log", tmp_path / "other.err")

    fields = {"log_paths": log_paths, "log_backup": None, "keeps_logs": True}
    driver = SimpleNamespace(**(fields | driver_fields))
    instances = {"web-1": SimpleNamespace(name="web-1", driver=driver)}
    sent: list[apb.AgentMessage] = []
    sessions = Sessions(instances, sent.append, LogKeeper(instances, 1 << 20))  # type: ignore[arg-type]
    return sessions, sent, driver


def setup(tmp_path: Path) -> tuple[Sessions, list[apb.AgentMessage], Path]:
    sessions, sent, _ = two_streams(tmp_path, b"x" * (100 << 10), b"")  # four chunks
    return sessions, sent, tmp_path / "stdout.log"


def stamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def outputs(sent: list[apb.AgentMessage]) -> list[apb.SessionOutput]:
    return [m.session_output for m in sent]


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0.01)


async def test_outputs_wait_for_credit(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT)
    sessions.on_open(apb.SessionOpen(session="s1", logs=req, credit=2))
    await settle()
    assert [o.WhichOneof("body") for o in outputs(sent)] == ["log", "log"]  # then it waits
    sessions.on_input(apb.SessionInput(session="s1", credit=10))
    await settle()
    kinds = [o.WhichOneof("body") for o in outputs(sent)]
    assert kinds == ["log"] * 4 + ["end"]
    assert sum(len(o.log.data) for o in outputs(sent)[:4]) == 100 << 10
    assert outputs(sent)[-1].end.code == code_pb2.OK and len(sessions) == 0


async def test_cancel_and_disconnect_end_sessions_without_a_word(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    follow = pb.ReadLogsRequest(instance="web-1", follow=True)
    sessions.on_open(apb.SessionOpen(session="s1", logs=follow, credit=100))
    sessions.on_open(apb.SessionOpen(session="s2", logs=follow, credit=100))
    await settle()
    assert len(sessions) == 2
    sessions.on_input(apb.SessionInput(session="s1", cancel=True))
    sessions.close_all()
    await settle()
    assert len(sessions) == 0
    assert not [o for o in outputs(sent) if o.WhichOneof("body") == "end"]


async def test_unknown_instance_ends_not_found(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_open(apb.SessionOpen(session="s1", logs=pb.ReadLogsRequest(instance="nope")))
    await settle()
    (end,) = outputs(sent)
    assert end.end.code == code_pb2.NOT_FOUND and "nope" in end.end.message


async def test_a_follow_ends_when_the_instance_goes(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    follow = pb.ReadLogsRequest(instance="web-1", follow=True, stream=pb.LogChunk.STDOUT)
    sessions.on_open(apb.SessionOpen(session="s1", logs=follow, credit=100))
    await settle()
    assert len(sessions) == 1
    del sessions.instances["web-1"]  # type: ignore[attr-defined]
    for _ in range(100):
        if not len(sessions):
            break
        await asyncio.sleep(0.05)
    assert not len(sessions)
    last = outputs(sent)[-1]
    assert last.WhichOneof("body") == "end" and last.end.code == code_pb2.OK


def test_the_log_keeper_looks_only_at_drivers_that_keep_log_files(tmp_path: Path) -> None:
    def inst(name: str, **driver: object) -> SimpleNamespace:
        paths = (tmp_path / name / "stdout.log", tmp_path / name / "stderr.log")
        fields = {"log_paths": lambda _: paths, "log_backup": None, "keeps_logs": True} | driver
        return SimpleNamespace(name=name, driver=SimpleNamespace(**fields))

    instances = {
        "web-1": inst("web-1"),
        "vm-1": inst("vm-1", log_backup="console.log.0"),  # virtlogd bounds its own
        "fake-1": inst("fake-1", keeps_logs=False),  # writes none
    }
    keeper = LogKeeper(instances, 1 << 20)  # type: ignore[arg-type]
    assert keeper.paths() == [tmp_path / "web-1" / "stderr.log", tmp_path / "web-1" / "stdout.log"]
    from orka.runtime.fake import FakeDriver

    assert FakeDriver.keeps_logs is False


async def read_all(
    sessions: Sessions, sent: list[apb.AgentMessage], req: pb.ReadLogsRequest
) -> dict[int, bytes]:
    """Each stream's bytes of one session, once it ended OK."""
    sessions.on_open(apb.SessionOpen(session="s1", logs=req, credit=1000))
    for _ in range(200):
        if outputs(sent) and outputs(sent)[-1].WhichOneof("body") == "end":
            break
        await asyncio.sleep(0.02)
    *chunks, end = outputs(sent)
    assert end.end.code == code_pb2.OK, end.end.message
    got: dict[int, bytes] = {}
    for o in chunks:
        assert o.session == "s1"
        got[o.log.stream] = got.get(o.log.stream, b"") + o.log.data
    return got


async def test_both_streams_are_read_whole_and_apart(tmp_path: Path) -> None:
    # stderr is short and ends first: stdout (four chunks) is still read to its end.
    big = b"o" * (100 << 10)
    sessions, sent, _ = two_streams(tmp_path, big, b"e1\ne2\n")
    got = await read_all(sessions, sent, pb.ReadLogsRequest(instance="web-1"))
    assert got == {pb.LogChunk.STDOUT: big, pb.LogChunk.STDERR: b"e1\ne2\n"}


async def test_one_stream_asked_for_is_the_only_one_read(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"o\n", b"e\n")
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDERR)
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDERR: b"e\n"}


async def test_one_file_for_both_streams_is_read_once_as_stdout(tmp_path: Path) -> None:
    sessions, sent, driver = two_streams(tmp_path, b"both\n", b"")
    out = tmp_path / "stdout.log"
    driver.log_paths = lambda name: (out, out)
    got = await read_all(sessions, sent, pb.ReadLogsRequest(instance="web-1"))
    assert got == {pb.LogChunk.STDOUT: b"both\n"}


async def test_tail_lines_start_at_the_last_lines(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"1\n2\n3\n4\n", b"a\nb\n")
    got = await read_all(sessions, sent, pb.ReadLogsRequest(instance="web-1", tail_lines=2))
    assert got == {pb.LogChunk.STDOUT: b"3\n4\n", pb.LogChunk.STDERR: b"a\nb\n"}


async def test_since_skips_a_file_not_written_since(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"old\n", b"new\n")
    now = time.time()
    os.utime(tmp_path / "stdout.log", (now - 3600, now - 3600))
    since = stamp(now - 60)
    req = pb.ReadLogsRequest(instance="web-1", since_time=since)
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDERR: b"new\n"}


async def test_since_and_tail_start_at_the_later_of_the_two(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"1\n2\n3\n4\n", b"")
    out = tmp_path / "stdout.log"
    now = time.time()
    # The keeper saw the file at 4 bytes ("1\n2\n") an hour ago, then at its size now.
    index = sessions.keeper.indexes[out] = SizeIndex()
    index.note(now - 3600, 4)
    index.note(now, 8)
    since = stamp(now - 60)
    by_since = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT, since_time=since)
    assert await read_all(sessions, sent, by_since) == {pb.LogChunk.STDOUT: b"3\n4\n"}
    sent.clear()
    # A tail of 1 starts later than `since`; a tail of 3 earlier, so `since` wins.
    for tail, want in ((1, b"4\n"), (3, b"3\n4\n")):
        req = pb.ReadLogsRequest(
            instance="web-1", stream=pb.LogChunk.STDOUT, since_time=since, tail_lines=tail
        )
        assert await read_all(sessions, sent, req) == {pb.LogChunk.STDOUT: want}
        sent.clear()


async def test_a_renaming_driver_has_its_older_file_read_first(tmp_path: Path) -> None:
    # virtlogd's way: the older log is renamed to `<file>.0`, and a new file started.
    sessions, sent, _ = two_streams(tmp_path, b"new\n", b"", log_backup=".0")
    (tmp_path / "stdout.log.0").write_bytes(b"old\n")
    (tmp_path / "stdout.log.1").write_bytes(b"not this one\n")
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT)
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDOUT: b"old\nnew\n"}


def test_credit_adds_up_and_one_wakes_a_waiting_session() -> None:
    session = Session("s1", 0, lambda msg: None)
    session.grant(0)
    assert not session._credit_given.is_set()
    session.grant(1)
    assert session._credit_given.is_set() and session.credit == 1
    session.grant(3)
    assert session.credit == 4


async def test_since_is_to_the_second(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"1\n2\n3\n", b"")
    since_s = time.time() - 10
    index = sessions.keeper.indexes[tmp_path / "stdout.log"] = SizeIndex()
    index.note(since_s - 3, 0)
    index.note(since_s - 1, 2)  # "1\n" was written before `since`
    since = stamp(since_s)
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT, since_time=since)
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDOUT: b"2\n3\n"}


async def test_a_renaming_driver_has_its_older_file_in_since_and_tail(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"c\n", b"", log_backup=".0")
    (tmp_path / "stdout.log.0").write_bytes(b"a\nb\n")
    since = stamp(time.time() - 60)
    by_since = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT, since_time=since)
    assert await read_all(sessions, sent, by_since) == {pb.LogChunk.STDOUT: b"a\nb\nc\n"}
    sent.clear()
    by_tail = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT, tail_lines=2)
    assert await read_all(sessions, sent, by_tail) == {pb.LogChunk.STDOUT: b"b\nc\n"}


@pytest.mark.parametrize("since_wins", [False, True])
async def test_a_tail_is_what_the_file_held_when_it_was_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, since_wins: bool
) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"1\n2\n3\n4\n", b"")
    out = tmp_path / "stdout.log"
    counted = logfiles.tail_position

    def count_then_write(path: Path, lines: int, backup: str) -> logfiles.Position:
        pos = counted(path, lines, backup)
        with path.open("ab") as f:
            f.write(b"5\n")  # the instance writes on while the session starts reading
        return pos

    monkeypatch.setattr(logfiles, "tail_position", count_then_write)
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT, tail_lines=3)
    if since_wins:
        index = sessions.keeper.indexes[out] = logfiles.SizeIndex()
        now = time.time()
        index.note(now - 3600, 4)
        since = stamp(now - 60)
        req.since_time.CopyFrom(since)
    want = b"3\n4\n" if since_wins else b"2\n3\n4\n"
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDOUT: want}


@pytest.mark.parametrize(("backup", "renamed"), [(None, False), (".0", True)])
async def test_the_reader_is_told_how_the_driver_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backup: str | None, renamed: bool
) -> None:
    asked: list[tuple[str, bool]] = []
    real = logfiles.follow

    def follow(*args: object, backup: str, renamed: bool) -> object:
        asked.append((backup, renamed))
        return real(*args, backup=backup, renamed=renamed)  # type: ignore[arg-type]

    monkeypatch.setattr(logfiles, "follow", follow)
    sessions, sent, _ = two_streams(tmp_path, b"x\n", b"", log_backup=backup)
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT)
    assert await read_all(sessions, sent, req) == {pb.LogChunk.STDOUT: b"x\n"}
    assert asked == [(backup or logfiles.BACKUP, renamed)]


async def test_a_follow_stops_both_readers_when_the_instance_goes(tmp_path: Path) -> None:
    sessions, sent, _ = two_streams(tmp_path, b"o\n", b"e\n")
    req = pb.ReadLogsRequest(instance="web-1", follow=True)
    sessions.on_open(apb.SessionOpen(session="s1", logs=req, credit=100))
    for _ in range(100):
        if len(sent) == 2:
            break
        await asyncio.sleep(0.02)
    del sessions.instances["web-1"]  # type: ignore[attr-defined]
    for _ in range(100):
        if not len(sessions):
            break
        await asyncio.sleep(0.05)
    kinds = [o.WhichOneof("body") for o in outputs(sent)]
    assert kinds == ["log", "log", "end"] and outputs(sent)[-1].end.code == code_pb2.OK
