"""A command run inside a running instance (`orka exec`): what a driver hands back.

`ExecHandle` is the one shape the agent's exec session drives: `read()` gives
(STDOUT|STDERR, bytes) until both streams end, `write` / `close_stdin` / `resize` pass the
user's input on, `wait()` gives the exit code, `kill()` ends it early. Drivers make one: the
process driver runs the command as a child through its launcher in the instance's context
(`SubprocessExec`), containerd through its Exec API with FIFOs (orka.runtime.containerd).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import termios
from abc import ABC, abstractmethod
from dataclasses import dataclass

STDOUT, STDERR = 1, 2
READ_SIZE = 32 << 10


@dataclass(frozen=True)
class ExecOptions:
    command: list[str]
    tty: bool = False
    stdin: bool = False
    rows: int = 0
    cols: int = 0


def set_winsize(fd: int, rows: int, cols: int) -> None:
    if rows > 0 and cols > 0:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def read_fd(fd: int) -> bytes:
    """One read of a non-blocking fd, waiting until it is readable; b"" at its end."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return os.read(fd, READ_SIZE)
        except BlockingIOError:
            pass
        except OSError:  # EIO: a pty whose other side is closed
            return b""
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(fd)


async def write_fd(fd: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
            continue
        except BlockingIOError:
            pass
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_writer(fd, _wake, ready)
        try:
            await ready
        finally:
            loop.remove_writer(fd)


class ExecHandle(ABC):
    def __init__(self) -> None:
        self._outputs: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(8)
        self._readers: list[asyncio.Task[None]] = []
        self._open = 0

    def _read_from(self, stream: int, fd: int) -> None:
        self._open += 1
        self._readers.append(asyncio.create_task(self._pump(stream, fd)))

    async def _pump(self, stream: int, fd: int) -> None:
        try:
            while data := await read_fd(fd):
                await self._outputs.put((stream, data))
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            await self._outputs.put(None)

    async def read(self) -> tuple[int, bytes] | None:
        """The next output, or None once every stream has ended."""
        while self._open:
            item = await self._outputs.get()
            if item is not None:
                return item
            self._open -= 1
        return None

    @abstractmethod
    async def write(self, data: bytes) -> None: ...

    @abstractmethod
    async def close_stdin(self) -> None: ...

    @abstractmethod
    async def resize(self, rows: int, cols: int) -> None: ...

    @abstractmethod
    async def wait(self) -> int: ...

    @abstractmethod
    async def kill(self) -> None: ...

    async def close(self) -> None:
        for task in self._readers:
            task.cancel()


class SubprocessExec(ExecHandle):
    """A child of the agent: pipes, or a pty when `tty` (stdout and stderr are one stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.proc: asyncio.subprocess.Process | None = None
        self._stdin: int | None = None
        self._pty: int | None = None

    @classmethod
    async def start(
        cls, argv: list[str], env: dict[str, str], cwd: str, options: ExecOptions
    ) -> SubprocessExec:
        self = cls()
        if options.tty:
            master, slave = os.openpty()
            set_winsize(master, options.rows, options.cols)
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                    start_new_session=True,
                )  # fmt: skip
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            self._pty = master
            self._stdin = os.dup(master)
            os.set_blocking(self._stdin, False)
            self._read_from(STDOUT, master)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            in_r, in_w = os.pipe() if options.stdin else (os.open(os.devnull, os.O_RDONLY), -1)
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=in_r, stdout=out_w, stderr=err_w, env=env, cwd=cwd,
                    start_new_session=True,
                )  # fmt: skip
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            for fd in (out_r, err_r):
                os.set_blocking(fd, False)
            if in_w >= 0:
                os.set_blocking(in_w, False)
                self._stdin = in_w
            self._read_from(STDOUT, out_r)
            self._read_from(STDERR, err_r)
        return self

    async def write(self, data: bytes) -> None:
        if self._stdin is not None:
            try:
                await write_fd(self._stdin, data)
            except OSError:  # the command closed its stdin or ended
                await self.close_stdin()

    async def close_stdin(self) -> None:
        if self._stdin is not None:
            fd, self._stdin = self._stdin, None
            if self._pty is not None:
                # A terminal has no end of input but ^D at the start of a line.
                with contextlib.suppress(OSError):
                    os.write(fd, b"\x04")
            with contextlib.suppress(OSError):
                os.close(fd)

    async def resize(self, rows: int, cols: int) -> None:
        if self._pty is not None:
            with contextlib.suppress(OSError):
                set_winsize(self._pty, rows, cols)

    async def wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        return code if code >= 0 else 128 - code

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        await self.close_stdin()
        await super().close()
