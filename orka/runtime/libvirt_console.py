"""`orka console`: a VM's serial console, through libvirt's virDomainOpenConsole.

The first serial port is a pty whose output libvirt also logs to the instance's console.log
(the VM's stdout for `orka logs`), so the log keeps working while someone is attached. The
console is a virStream: a thread of its own blocks in `recv` (libvirt-python's streams are
blocking without libvirt's event loop) and hands what arrives to the event loop; keys go out
with `send` on the driver's thread pool. FORCE takes the console over from an earlier session
(one left behind by a client that vanished), as `virsh console --force` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from orka.runtime.execs import STDOUT, ExecHandle

_CONSOLE_FORCE = 1
_STREAM_NONBLOCK = 0


class LibvirtConsole(ExecHandle):
    def __init__(self, stream: Any, run: Callable[..., Any]) -> None:
        super().__init__()
        self._stream = stream
        self._run = run  # runs a blocking call on the driver's pool
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(8)
        self._ended = asyncio.Event()
        self._open = 1
        self._closed = False
        threading.Thread(target=self._receive, name="orka-console", daemon=True).start()

    @classmethod
    async def open(cls, conn: Any, domain: Any, run: Callable[..., Any]) -> LibvirtConsole:
        stream = await run(conn.newStream, _STREAM_NONBLOCK)
        await run(domain.openConsole, None, stream, _CONSOLE_FORCE)
        return cls(stream, run)

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._stream.recv(32 << 10)
            except Exception:
                data = b""
            if isinstance(data, int):  # -2: would block (not in blocking mode)
                continue
            fut = asyncio.run_coroutine_threadsafe(self._queue.put(data), self._loop)
            with contextlib.suppress(Exception):
                fut.result()
            if not data:
                return

    async def read(self) -> tuple[int, bytes] | None:
        if not self._open:
            return None
        data = await self._queue.get()
        if not data:
            self._open = 0
            return None
        return STDOUT, data

    async def write(self, data: bytes) -> None:
        with contextlib.suppress(Exception):
            await self._run(self._stream.send, data)

    async def close_stdin(self) -> None:
        pass

    async def resize(self, rows: int, cols: int) -> None:
        pass  # a serial line has no size

    async def wait(self) -> int:
        return 0

    async def kill(self) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            await self._run(self._stream.abort)
