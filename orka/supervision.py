"""The parts of a service, supervised: the first part that ends stops the whole service.

A service (the scheduler, the agent) is a few parts, each owning one job and, where the job
has a loop, one `run()`. A part's loop runs until the service stops it; if one raises (or
returns early) nothing else would notice, and the service would go on half alive (nodes no
longer declared lost, heartbeats no longer sent). `Parts` runs them as tasks and turns the
first such end into one log line and a call that stops the service, whose `run()` then
raises `PartFailed` (the process exits non-zero).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("orka.supervision")


def describe(error: BaseException | None) -> str:
    if error is None:
        return "returned while the service was running"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class PartFailed(Exception):
    """A part of a service ended while the service ran; the service stopped because of it."""

    def __init__(self, service: str, part: str, error: BaseException | None) -> None:
        super().__init__(f"{service}: its {part} failed ({describe(error)}); stopped")
        self.service = service
        self.part = part
        self.error = error


class Parts:
    """Runs each part's `run()` as a task of its own and watches them all."""

    def __init__(self, service: str, on_failure: Callable[[PartFailed], None]) -> None:
        self.service = service
        self.on_failure = on_failure
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False

    def start(self, part: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run `run()` as the part's task."""

        async def main() -> None:
            await run()

        self.watch(part, asyncio.create_task(main(), name=part))

    def watch(self, part: str, task: asyncio.Task[None]) -> None:
        """Supervise a task a part runs itself (one it starts on demand)."""
        if part in self.tasks:
            raise ValueError(f"{self.service}: part {part!r} is already running")
        task.add_done_callback(functools.partial(self._ended, part))
        self.tasks[part] = task

    def stopping(self) -> None:
        """The service has begun to stop (it may end some parts' tasks itself on the way):
        from now on no part's end is a failure."""
        self._stopping = True

    def _ended(self, part: str, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        # The first end stops the service; what ends while it stops is no news.
        self._stopping = True
        # Cancelled by anything but stop() (a library cancelling what the part awaited, as
        # grpc.aio does to the calls of a closed channel): the part is gone all the same.
        error = (
            asyncio.CancelledError("cancelled while the service ran")
            if task.cancelled()
            else task.exception()
        )
        failure = PartFailed(self.service, part, error)
        log.error(
            "service part failed; stopping the service",
            # No `service` key here: the process's logger names it (orka.log), more exactly.
            part=part,
            error=describe(error),
            exc_info=error,
        )
        self.on_failure(failure)

    async def stop(self) -> None:
        """Cancel every part and wait for each to end; idempotent."""
        self._stopping = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
