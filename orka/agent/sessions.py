"""Sessions on the agent's stream: logs (and exec, console) the scheduler opens for a reader.

Each session is one task. What it sends is paced by credit: the scheduler grants a window of
outputs at the open and more as its reader takes them, and a session with none left waits
(it stops reading files, or reading the command's pipes), so a slow reader never grows a
queue here and never holds back the heartbeats that share the stream. The session ends with
an `end` status (OK, or why); a `cancel` from the scheduler, or the stream going away, ends
it with nothing more sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import structlog

from orka.agent.logs import LogKeeper
from orka.agent.supervisor import Supervised
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Invalid, NotFound, OrkaError, ResourceExhausted, to_rpc_status
from orka.rpc import convert
from orka.runtime import logs as logfiles
from orka.runtime.execs import STDOUT, ExecHandle, ExecOptions

log = structlog.get_logger("orka.agent")

MAX_SESSIONS = 64
# Inputs (stdin, console keys) queued for a session; the controller sends them as the user
# types or pipes, at most 32 KiB each.
MAX_QUEUED_INPUTS = 64
# How much of a VM's console log a console session starts with.
CONSOLE_HISTORY = 16 << 10


class Session:
    def __init__(self, sid: str, credit: int, send: Callable[[apb.AgentMessage], None]) -> None:
        self.sid = sid
        self._send = send
        self.credit = credit
        self._credit_given = asyncio.Event()
        self.inputs: asyncio.Queue[apb.SessionInput] = asyncio.Queue(MAX_QUEUED_INPUTS)
        self.task: asyncio.Task[None] | None = None

    def grant(self, n: int) -> None:
        self.credit += n
        if self.credit > 0:
            self._credit_given.set()

    async def emit(self, out: apb.SessionOutput) -> None:
        while self.credit <= 0:
            self._credit_given.clear()
            await self._credit_given.wait()
        self.credit -= 1
        out.session = self.sid
        self._send(apb.AgentMessage(session_output=out))

    def end(self, status: object) -> None:
        out = apb.SessionOutput(session=self.sid)
        out.end.CopyFrom(status)  # type: ignore[arg-type]
        self._send(apb.AgentMessage(session_output=out))


Handler = Callable[[Session, apb.SessionOpen], Awaitable[None]]


class Sessions:
    def __init__(
        self,
        instances: Mapping[str, Supervised],
        send: Callable[[apb.AgentMessage], None],
        keeper: LogKeeper,
    ) -> None:
        self.instances = instances
        self.send = send
        self.keeper = keeper
        self._sessions: dict[str, Session] = {}
        # The other kinds (exec, console) register their handlers here.
        self.handlers: dict[str, Handler] = {
            "logs": self._logs,
            "exec": self._exec,
            "console": self._console,
        }

    def __len__(self) -> int:
        return len(self._sessions)

    def on_open(self, msg: apb.SessionOpen) -> None:
        session = Session(msg.session, msg.credit, self.send)
        if msg.session in self._sessions or not msg.session:
            session.end(to_rpc_status(Invalid("session id missing or in use")))
            return
        if len(self._sessions) >= MAX_SESSIONS:
            session.end(
                to_rpc_status(ResourceExhausted(f"at most {MAX_SESSIONS} sessions per node"))
            )
            return
        self._sessions[msg.session] = session
        session.task = asyncio.create_task(self._run(session, msg), name=f"session-{msg.session}")

    def on_input(self, msg: apb.SessionInput) -> None:
        session = self._sessions.get(msg.session)
        if session is None:
            return  # ended already; the scheduler learns from its end
        kind = msg.WhichOneof("body")
        if kind == "credit":
            session.grant(msg.credit)
        elif kind == "cancel":
            self._drop(session)
        else:
            try:
                session.inputs.put_nowait(msg)
            except asyncio.QueueFull:
                self._drop(session)
                session.end(to_rpc_status(ResourceExhausted("session input queue is full")))

    def close_all(self) -> None:
        """The stream is gone: every session with it (their readers are gone too)."""
        for session in list(self._sessions.values()):
            self._drop(session)

    def _drop(self, session: Session) -> None:
        self._sessions.pop(session.sid, None)
        if session.task is not None:
            session.task.cancel()

    async def _run(self, session: Session, msg: apb.SessionOpen) -> None:
        try:
            handler = self.handlers.get(msg.WhichOneof("kind") or "")
            if handler is None:
                raise Invalid("session kind not supported by this agent")
            await handler(session, msg)
            status = convert.ok_status()
        except asyncio.CancelledError:
            return
        except OrkaError as err:
            status = to_rpc_status(err)
        except Exception as err:
            log.exception("session failed", session=session.sid)
            status = to_rpc_status(OrkaError(f"session failed: {err}"))
        finally:
            self._sessions.pop(session.sid, None)
        session.end(status)

    def instance(self, name: str) -> Supervised:
        inst = self.instances.get(name)
        if inst is None:
            raise NotFound(f"instance {name!r} is not on this node")
        return inst

    # ---- logs ----

    async def _logs(self, session: Session, msg: apb.SessionOpen) -> None:
        req = msg.logs
        inst = self.instance(req.instance)
        out, err = inst.driver.log_paths(inst.name)
        streams: list[tuple[int, Path]] = [(pb.LogChunk.STDOUT, out)]
        if err != out:
            streams.append((pb.LogChunk.STDERR, err))
        if req.stream:
            streams = [s for s in streams if s[0] == req.stream]
        since = req.since_time.ToNanoseconds() / 1e9 if req.HasField("since_time") else None
        backup = inst.driver.log_backup
        tasks = [
            asyncio.create_task(
                self._read_stream(session, kind, path, req.follow, req.tail_lines, since, backup)
            )
            for kind, path in streams
        ]
        if req.follow:
            # A follow ends when the instance is removed from the node (its files go too).
            tasks.append(asyncio.create_task(self._until_gone(inst)))
        try:
            # Both streams to their end (a follow: until the instance goes), or the first
            # failure, which stops the other stream too.
            when = asyncio.FIRST_COMPLETED if req.follow else asyncio.FIRST_EXCEPTION
            done, _ = await asyncio.wait(tasks, return_when=when)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _until_gone(self, inst: Supervised, interval: float = 1.0) -> None:
        # Polled: the runner removes instances in several places, none of which signals.
        while self.instances.get(inst.name) is inst:  # noqa: ASYNC110
            await asyncio.sleep(interval)

    async def _read_stream(
        self,
        session: Session,
        kind: int,
        path: Path,
        follow: bool,
        tail_lines: int,
        since: float | None,
        renamed_to: str | None,
    ) -> None:
        backup = renamed_to or logfiles.BACKUP
        if since is not None:
            index = self.keeper.indexes.get(path)
            start = logfiles.since_position(path, since, index, backup)
        else:
            start = logfiles.Position(0, rotated=True)
        if tail_lines > 0:
            tail = await asyncio.to_thread(logfiles.tail_position, path, tail_lines, backup)
            start = dataclasses.replace(_later(start, tail), end=tail.end)
        renamed = renamed_to is not None
        async for data in logfiles.follow(path, start, follow, backup=backup, renamed=renamed):
            await session.emit(apb.SessionOutput(log=pb.LogChunk(stream=kind, data=data)))  # type: ignore[arg-type]

    # ---- exec ----

    async def _exec(self, session: Session, msg: apb.SessionOpen) -> None:
        start = msg.exec
        inst = self.instance(start.instance)
        options = ExecOptions(
            command=list(start.command),
            tty=start.tty,
            stdin=start.stdin,
            rows=start.size.rows,
            cols=start.size.cols,
        )
        handle = await inst.driver.exec(inst.name, inst.spec, options)
        log.info("exec", instance=inst.name, command=options.command[:1], session=session.sid)
        await _drive(session, handle, console=False)

    # ---- console ----

    async def _console(self, session: Session, msg: apb.SessionOpen) -> None:
        inst = self.instance(msg.console)
        handle = await inst.driver.console(inst.name)
        log.info("console attached", instance=inst.name, session=session.sid)
        # What the screen showed last (the log's tail), then what comes: attached first, so
        # nothing is missed between the two (a few bytes at that moment may show twice).
        log_path, _ = inst.driver.log_paths(inst.name)
        recent = await asyncio.to_thread(_tail_bytes, log_path, CONSOLE_HISTORY)
        if recent:
            await session.emit(apb.SessionOutput(console=recent))
        await _drive(session, handle, console=True)


async def _drive(session: Session, handle: ExecHandle, console: bool) -> None:
    """Outputs to the session (an exec's exit code last), the session's inputs to `handle`."""
    inputs = asyncio.create_task(_feed(session, handle))
    try:
        while (item := await handle.read()) is not None:
            stream, data = item
            if console:
                await session.emit(apb.SessionOutput(console=data))
                continue
            if stream == STDOUT:
                resp = pb.ExecResponse(stdout=data)
            else:
                resp = pb.ExecResponse(stderr=data)
            await session.emit(apb.SessionOutput(exec=resp))
        if not console:
            code = await handle.wait()
            await session.emit(apb.SessionOutput(exec=pb.ExecResponse(exit_code=code)))
    except asyncio.CancelledError:
        await handle.kill()
        raise
    finally:
        inputs.cancel()
        await handle.close()


async def _feed(session: Session, handle: ExecHandle) -> None:
    """The user's input to the command: stdin, terminal size, end of input."""
    while True:
        inp = await session.inputs.get()
        kind = inp.WhichOneof("body")
        if kind == "data":
            await handle.write(inp.data)
        elif kind == "resize":
            await handle.resize(inp.resize.rows, inp.resize.cols)
        elif kind == "close_input":
            await handle.close_stdin()


def _later(a: logfiles.Position, b: logfiles.Position) -> logfiles.Position:
    """The later of two starts in the same file pair (`<file>.1` comes first)."""
    return max(a, b, key=lambda p: (not p.rotated, p.offset))


def _tail_bytes(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - limit))
            return f.read(limit)
    except OSError:
        return b""
