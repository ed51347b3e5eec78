"""Exec and console sessions on the agent's stream, with real commands (`SubprocessExec`).

The driver here is a stand-in that records what it was asked for and starts the command on
this machine; what the session sends (outputs, the exit code, the end) and what reaches the
command (stdin, a terminal size, the end of input) are real.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from google.rpc import code_pb2

from orka.agent import sessions as sessions_mod
from orka.agent.logs import LogKeeper
from orka.agent.sessions import MAX_QUEUED_INPUTS, MAX_SESSIONS, Sessions
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.runtime.execs import ExecHandle, ExecOptions, SubprocessExec
from tests.waits import until


class Driver:
    """Runs each exec's command here; a console is `console_argv` (`cat` echoes keys)."""

    def __init__(self, log_path: Path, console_argv: list[str] | None = None) -> None:
        self.log_path = log_path
        self.console_argv = console_argv or ["cat"]
        self.asked: list[tuple[str, object, ExecOptions]] = []
        self.handles: list[SubprocessExec] = []
        self.log_backup = None
        self.keeps_logs = True

    def log_paths(self, name: str) -> tuple[Path, Path]:
        # The instance's own files, so a session asking for another's reads nothing.
        if name != "web-1":
            return self.log_path.with_name("other.log"), self.log_path.with_name("other.err")
        return self.log_path, self.log_path.with_name("stderr.log")

    async def exec(self, name: str, spec: object, options: ExecOptions) -> ExecHandle:
        self.asked.append((name, spec, options))
        handle = await SubprocessExec.start(options.command, dict(os.environ), "/", options)
        self.handles.append(handle)
        return handle

    async def console(self, name: str) -> ExecHandle:
        self.asked.append((name, None, ExecOptions(command=self.console_argv)))
        options = ExecOptions(command=self.console_argv, stdin=True)
        handle = await SubprocessExec.start(self.console_argv, dict(os.environ), "/", options)
        self.handles.append(handle)
        return handle


# A follow of one stream: a session that lasts until it is closed, and reads no input.
FOLLOW = pb.ReadLogsRequest(instance="web-1", follow=True, stream=pb.LogChunk.STDOUT)


def setup(
    tmp_path: Path, console_argv: list[str] | None = None
) -> tuple[Sessions, list[apb.AgentMessage], Driver]:
    driver = Driver(tmp_path / "stdout.log", console_argv)
    spec = SimpleNamespace(name="web")
    instances = {"web-1": SimpleNamespace(name="web-1", driver=driver, spec=spec)}
    sent: list[apb.AgentMessage] = []
    sessions = Sessions(instances, sent.append, LogKeeper(instances, 1 << 20))  # type: ignore[arg-type]
    return sessions, sent, driver


def outputs(sent: list[apb.AgentMessage]) -> list[apb.SessionOutput]:
    return [m.session_output for m in sent]


def ended(sent: list[apb.AgentMessage]) -> bool:
    return any(o.WhichOneof("body") == "end" for o in outputs(sent))


def exec_open(sid: str, command: list[str], credit: int = 100, **fields: object) -> apb.SessionOpen:
    return apb.SessionOpen(
        session=sid, credit=credit, exec=pb.ExecStart(instance="web-1", command=command, **fields)
    )


def stream_bytes(sent: list[apb.AgentMessage], field: str) -> bytes:
    return b"".join(getattr(o.exec, field) for o in outputs(sent) if o.WhichOneof("body") == "exec")


async def test_exec_sends_both_streams_apart_then_the_exit_code_then_ok(tmp_path: Path) -> None:
    sessions, sent, driver = setup(tmp_path)
    cmd = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    sessions.on_open(exec_open("s1", cmd, tty=False, stdin=False))
    await until(lambda: ended(sent))
    assert stream_bytes(sent, "stdout") == b"out\n"
    assert stream_bytes(sent, "stderr") == b"err\n"
    *body, code, end = outputs(sent)
    assert all(o.session == "s1" for o in outputs(sent))
    assert {o.exec.WhichOneof("body") for o in body} == {"stdout", "stderr"}
    assert code.exec.WhichOneof("body") == "exit_code" and code.exec.exit_code == 3
    assert end.end.code == code_pb2.OK
    assert len(sessions) == 0
    (name, spec, options) = driver.asked[0]
    assert (name, spec.name) == ("web-1", "web")  # type: ignore[attr-defined]
    assert options == ExecOptions(command=cmd, tty=False, stdin=False, rows=0, cols=0)


async def test_exec_passes_the_terminal_and_stdin_asked_for(tmp_path: Path) -> None:
    sessions, sent, driver = setup(tmp_path)
    size = pb.TerminalSize(rows=30, cols=100)
    sessions.on_open(exec_open("s1", ["sh", "-c", "stty size"], tty=True, stdin=True, size=size))
    await until(lambda: ended(sent))
    assert driver.asked[0][2] == ExecOptions(
        command=["sh", "-c", "stty size"], tty=True, stdin=True, rows=30, cols=100
    )
    # A terminal: one stream, the size the user's terminal has.
    assert stream_bytes(sent, "stdout").strip() == b"30 100"
    assert stream_bytes(sent, "stderr") == b""


async def test_stdin_reaches_the_command_and_its_end_ends_it(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_open(exec_open("s1", ["cat"], stdin=True))
    sessions.on_input(apb.SessionInput(session="s1", data=b"hello "))
    sessions.on_input(apb.SessionInput(session="s1", data=b"world"))
    await until(lambda: stream_bytes(sent, "stdout") == b"hello world")
    assert not ended(sent)
    sessions.on_input(apb.SessionInput(session="s1", close_input=True))
    await until(lambda: ended(sent))
    assert outputs(sent)[-2].exec.exit_code == 0
    assert outputs(sent)[-1].end.code == code_pb2.OK


async def test_a_resize_reaches_the_commands_terminal(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    size = pb.TerminalSize(rows=10, cols=20)
    cmd = ["sh", "-c", "stty -echo; read line; stty size"]
    sessions.on_open(exec_open("s1", cmd, tty=True, stdin=True, size=size))
    # The resize is queued before the line the command waits for, so it is applied first.
    resize = pb.TerminalSize(rows=44, cols=132)
    sessions.on_input(apb.SessionInput(session="s1", resize=resize))
    sessions.on_input(apb.SessionInput(session="s1", data=b"go\n"))
    await until(lambda: ended(sent))
    assert stream_bytes(sent, "stdout").split()[-2:] == [b"44", b"132"]


async def test_a_cancelled_exec_kills_its_command_and_says_nothing(tmp_path: Path) -> None:
    sessions, sent, driver = setup(tmp_path)
    sessions.on_open(exec_open("s1", ["sh", "-c", "echo started; exec sleep 60"]))
    await until(lambda: stream_bytes(sent, "stdout") == b"started\n")
    task = sessions._sessions["s1"].task
    sessions.on_input(apb.SessionInput(session="s1", cancel=True))
    (handle,) = driver.handles
    assert handle.proc is not None
    async with asyncio.timeout(10):
        assert await handle.proc.wait() == -9
    # The session's task ends quietly too: no error left in it for asyncio to report.
    assert task is not None
    await asyncio.wait([task], timeout=10)
    assert task.done() and not task.cancelled() and task.exception() is None
    assert not ended(sent) and len(sessions) == 0


async def test_exec_output_waits_for_credit(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    cmd = ["sh", "-c", "echo 1; sleep 0.2; echo 2; sleep 0.2; echo 3"]
    sessions.on_open(exec_open("s1", cmd, credit=1))
    await until(lambda: len(sent) == 1)
    await asyncio.sleep(0.6)  # the command has ended; the session holds the rest
    assert [o.exec.stdout for o in outputs(sent)] == [b"1\n"]
    sessions.on_input(apb.SessionInput(session="s1", credit=10))
    await until(lambda: ended(sent))
    assert stream_bytes(sent, "stdout") == b"1\n2\n3\n"


async def test_console_starts_with_the_logs_last_16_kib_then_echoes_keys(tmp_path: Path) -> None:
    sessions, sent, driver = setup(tmp_path)
    history = bytes(range(256)) * 100  # 25,600 bytes
    driver.log_path.write_bytes(history)
    sessions.on_open(apb.SessionOpen(session="c1", credit=100, console="web-1"))
    await until(lambda: len(sent) >= 1)
    assert outputs(sent)[0].console == history[-(16 << 10) :]
    # Each key comes back as its own output, and the session goes on after each.
    for typed in (b"k", b"ke", b"key"):
        sessions.on_input(apb.SessionInput(session="c1", data=typed[-1:]))
        await until(lambda t=typed: b"".join(o.console for o in outputs(sent)[1:]) == t)  # type: ignore[misc]
    sessions.on_input(apb.SessionInput(session="c1", close_input=True))
    await until(lambda: ended(sent))
    # A console has no exit code: its outputs, then the end.
    assert [o.WhichOneof("body") for o in outputs(sent)][-2:] == ["console", "end"]
    assert outputs(sent)[-1].end.code == code_pb2.OK
    assert driver.asked[0][0] == "web-1"


async def test_a_console_without_a_log_starts_with_what_comes(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path, console_argv=["echo", "booted"])
    sessions.on_open(apb.SessionOpen(session="c1", credit=100, console="web-1"))
    await until(lambda: ended(sent))
    assert [o.console for o in outputs(sent)[:-1]] == [b"booted\n"]


def test_tail_bytes_reads_a_short_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    path.write_bytes(b"abc")
    assert sessions_mod._tail_bytes(path, 2) == b"bc"
    assert sessions_mod._tail_bytes(path, 10) == b"abc"
    assert sessions_mod._tail_bytes(tmp_path / "none", 10) == b""


async def test_an_unknown_kind_ends_invalid(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_open(apb.SessionOpen(session="s1", credit=10))
    await until(lambda: ended(sent))
    (end,) = outputs(sent)
    assert end.session == "s1"
    assert (end.end.code, end.end.message) == (
        code_pb2.INVALID_ARGUMENT,
        "session kind not supported by this agent",
    )


@pytest.mark.parametrize("sid", ["", "s1"])
async def test_a_missing_or_used_session_id_is_refused(tmp_path: Path, sid: str) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_open(exec_open("s1", ["sleep", "60"]))
    sessions.on_open(exec_open(sid, ["true"]))
    await until(lambda: ended(sent))
    (end,) = [o for o in outputs(sent) if o.WhichOneof("body") == "end"]
    assert (end.session, end.end.code, end.end.message) == (
        sid,
        code_pb2.INVALID_ARGUMENT,
        "session id missing or in use",
    )
    assert len(sessions) == 1  # the first goes on
    sessions.close_all()


async def test_at_most_64_sessions_per_node(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    for i in range(MAX_SESSIONS):
        sessions.on_open(apb.SessionOpen(session=f"s{i}", logs=FOLLOW, credit=10))
    assert len(sessions) == 64 and not sent
    sessions.on_open(apb.SessionOpen(session="one-more", logs=FOLLOW, credit=10))
    (end,) = outputs(sent)
    assert (end.session, end.end.code, end.end.message) == (
        "one-more",
        code_pb2.RESOURCE_EXHAUSTED,
        "at most 64 sessions per node",
    )
    assert len(sessions) == 64
    sessions.close_all()
    await until(lambda: len(sessions) == 0)


async def test_a_full_input_queue_ends_the_session(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    # A log session reads no input: what it is sent stays queued.
    sessions.on_open(apb.SessionOpen(session="s1", logs=FOLLOW, credit=10))
    await asyncio.sleep(0)
    for _ in range(MAX_QUEUED_INPUTS):
        sessions.on_input(apb.SessionInput(session="s1", data=b"x"))
    assert not sent and len(sessions) == 1
    sessions.on_input(apb.SessionInput(session="s1", data=b"x"))
    (end,) = outputs(sent)
    assert (end.session, end.end.code, end.end.message) == (
        "s1",
        code_pb2.RESOURCE_EXHAUSTED,
        "session input queue is full",
    )
    assert len(sessions) == 0
    await asyncio.sleep(0.05)
    assert len(sent) == 1  # cancelled: no second end


async def test_input_for_an_ended_session_is_dropped(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_input(apb.SessionInput(session="gone", data=b"x"))
    sessions.on_input(apb.SessionInput(session="gone", credit=5))
    sessions.on_input(apb.SessionInput(session="gone", cancel=True))
    assert not sent and len(sessions) == 0


async def test_a_failing_handler_ends_internal_with_its_error(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)

    async def boom(session: object, msg: object) -> None:
        raise RuntimeError("disk on fire")

    sessions.handlers["exec"] = boom
    with structlog.testing.capture_logs() as logs:
        sessions.on_open(exec_open("s1", ["true"]))
        await until(lambda: ended(sent))
    (failed,) = [e for e in logs if e["log_level"] == "error"]
    assert (failed["event"], failed["session"]) == ("session failed", "s1")
    assert failed["exc_info"] is True
    (end,) = outputs(sent)
    assert (end.end.code, end.end.message) == (code_pb2.INTERNAL, "session failed: disk on fire")
    assert len(sessions) == 0


async def test_exec_on_a_driver_without_it_ends_with_the_drivers_refusal(tmp_path: Path) -> None:
    from orka.runtime.fake import FakeDriver

    sessions, sent, _ = setup(tmp_path)
    sessions.instances["web-1"].driver = FakeDriver()  # type: ignore[index]
    sessions.on_open(exec_open("s1", ["true"]))
    sessions.on_open(apb.SessionOpen(session="c1", credit=10, console="web-1"))
    await until(lambda: len([o for o in outputs(sent) if o.WhichOneof("body") == "end"]) == 2)
    ends = {o.session: o.end for o in outputs(sent)}
    assert ends["s1"].code == code_pb2.FAILED_PRECONDITION
    assert "exec is not supported" in ends["s1"].message
    assert ends["c1"].code == code_pb2.FAILED_PRECONDITION
    assert "only VMs have a console" in ends["c1"].message


async def test_each_exec_and_console_is_logged_without_the_commands_arguments(
    tmp_path: Path,
) -> None:
    sessions, sent, _ = setup(tmp_path)
    with structlog.testing.capture_logs() as logs:
        sessions.on_open(exec_open("s1", ["sh", "-c", "echo secret-token"]))
        await until(lambda: ended(sent))
        sessions.on_open(apb.SessionOpen(session="c1", credit=10, console="web-1"))
        await until(lambda: len(sessions) == 1 and len(logs) == 2)
        sessions.close_all()
    infos = [{k: v for k, v in e.items() if k != "log_level"} for e in logs]
    assert infos == [
        {"event": "exec", "instance": "web-1", "command": ["sh"], "session": "s1"},
        {"event": "console attached", "instance": "web-1", "session": "c1"},
    ]
    assert "secret-token" not in repr(logs)


async def test_a_sessions_task_is_named_for_it(tmp_path: Path) -> None:
    sessions, _, _ = setup(tmp_path)
    sessions.on_open(exec_open("s1", ["sleep", "60"]))
    task = sessions._sessions["s1"].task
    assert task is not None and task.get_name() == "session-s1"
    sessions.close_all()
