"""`orka exec` into a container: containerd's Tasks.Exec with FIFOs.

The process is the container's own (its spec's `process`: user, env, cwd, capabilities) with
the command and terminal swapped in, so it runs as the container's command does. Its IO goes
through FIFOs in a fresh dir under the instance's: we open our ends first (non-blocking
reads; stdin read-write so opening never blocks), containerd's shim opens its ends during
Exec, and a stream ends when the shim closes its end after the process exits. With a TTY the
shim makes a pty: stdout carries both streams and ResizePty sets its size.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import grpc

from orka.api.containerd.services.containers.v1 import containers_pb2 as cpb
from orka.api.containerd.services.tasks.v1 import tasks_pb2 as tpb
from orka.errors import Conflict, RuntimeFailure
from orka.runtime.execs import STDERR, STDOUT, ExecHandle, ExecOptions, write_fd

PROCESS_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/Process"


class ContainerdExec(ExecHandle):
    def __init__(self, tasks: Any, md: Any, instance: str, exec_id: str, fifo_dir: Path) -> None:
        super().__init__()
        self._tasks = tasks
        self._md = md
        self.instance = instance
        self.exec_id = exec_id
        self.fifo_dir = fifo_dir
        self._stdin: int | None = None
        self._waiter: asyncio.Task[int] | None = None
        self._outputs_fds: list[tuple[int, int]] = []

    @classmethod
    async def start(
        cls,
        containers: Any,
        tasks: Any,
        md: Any,
        instance: str,
        task_dir: Path,
        options: ExecOptions,
    ) -> ContainerdExec:
        try:
            got = await containers.Get(cpb.GetContainerRequest(id=instance), metadata=md)
        except grpc.aio.AioRpcError as err:
            raise Conflict(f"containerd: instance {instance!r}: {err.details()}") from None
        process: dict[str, Any] = json.loads(got.container.spec.value).get("process", {})
        process["args"] = list(options.command)
        process["terminal"] = options.tty
        if options.tty and options.rows and options.cols:
            process["consoleSize"] = {"height": options.rows, "width": options.cols}
        else:
            process.pop("consoleSize", None)
        exec_id = "exec-" + uuid.uuid4().hex[:12]
        fifo_dir = task_dir / exec_id
        self = cls(tasks, md, instance, exec_id, fifo_dir)
        paths = await asyncio.to_thread(self._fifos, options)
        try:
            await tasks.Exec(
                tpb.ExecProcessRequest(
                    container_id=instance,
                    exec_id=exec_id,
                    stdin=paths.get("stdin", ""),
                    stdout=paths["stdout"],
                    stderr=paths.get("stderr", ""),
                    terminal=options.tty,
                    spec={"type_url": PROCESS_TYPE_URL, "value": json.dumps(process).encode()},
                ),
                metadata=md,
            )
            # Wait before Start: an exit must not be missed.
            self._waiter = asyncio.create_task(self._wait())
            await tasks.Start(tpb.StartRequest(container_id=instance, exec_id=exec_id), metadata=md)
            self._read_outputs()
        except grpc.aio.AioRpcError as err:
            await self.close()
            code = err.code()
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise Conflict(f"containerd: instance {instance!r}: {err.details()}") from None
            raise RuntimeFailure(f"containerd: exec in {instance!r}: {err.details()}") from None
        return self

    def _fifos(self, options: ExecOptions) -> dict[str, str]:
        self.fifo_dir.mkdir(mode=0o700, parents=True)
        names = ["stdout"] + ([] if options.tty else ["stderr"])
        if options.stdin or options.tty:
            names.append("stdin")
        paths = {}
        for name in names:
            path = self.fifo_dir / name
            os.mkfifo(path, 0o600)
            paths[name] = str(path)
        # Our read ends are open before Exec: the shim's open of its write end waits for one.
        for name, stream in (("stdout", STDOUT), ("stderr", STDERR)):
            if name in paths:
                fd = os.open(paths[name], os.O_RDONLY | os.O_NONBLOCK)
                self._outputs_fds.append((stream, fd))
        if "stdin" in paths:
            self._stdin = os.open(paths["stdin"], os.O_RDWR | os.O_NONBLOCK)
        return paths

    def _read_outputs(self) -> None:
        """Start reading once the shim holds its ends (it opens them in Start): before, a FIFO
        with no writer reads as ended."""
        for stream, fd in self._outputs_fds:
            self._read_from(stream, fd)
        self._outputs_fds = []

    async def _wait(self) -> int:
        reply = await self._tasks.Wait(
            tpb.WaitRequest(container_id=self.instance, exec_id=self.exec_id), metadata=self._md
        )
        return int(reply.exit_status)

    async def write(self, data: bytes) -> None:
        if self._stdin is not None:
            try:
                await write_fd(self._stdin, data)
            except OSError:
                await self.close_stdin()

    async def close_stdin(self) -> None:
        if self._stdin is None:
            return
        fd, self._stdin = self._stdin, None
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._tasks.CloseIO(
                tpb.CloseIORequest(container_id=self.instance, exec_id=self.exec_id, stdin=True),
                metadata=self._md,
            )

    async def resize(self, rows: int, cols: int) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._tasks.ResizePty(
                tpb.ResizePtyRequest(
                    container_id=self.instance, exec_id=self.exec_id, width=cols, height=rows
                ),
                metadata=self._md,
            )

    async def wait(self) -> int:
        assert self._waiter is not None
        return await self._waiter

    async def kill(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._tasks.Kill(
                tpb.KillRequest(container_id=self.instance, exec_id=self.exec_id, signal=9),
                metadata=self._md,
            )

    async def close(self) -> None:
        for _, fd in self._outputs_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._outputs_fds = []
        await self.close_stdin()
        await super().close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._tasks.DeleteProcess(
                tpb.DeleteProcessRequest(container_id=self.instance, exec_id=self.exec_id),
                metadata=self._md,
            )
        await asyncio.to_thread(shutil.rmtree, self.fifo_dir, True)
