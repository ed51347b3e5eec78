"""The runtime shim: one interface the agent drives, with one driver per runtime.

Like Kubernetes' CRI, the agent never knows how a task runs; it only starts, watches, stops
and forgets instances through `Driver`. Drivers own their on-node state so that a restarted
agent can re-adopt what still runs (`Driver.list`).
"""

from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from orka.errors import Invalid, RuntimeFailure
from orka.models import WorkloadKind, WorkloadSpec

# Instance names become directory names, so anything that could escape the data dir is refused.
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def check_instance(instance: str) -> str:
    if not _INSTANCE_RE.match(instance):
        raise Invalid(f"instance name {instance!r} is not a valid runtime task name")
    return instance


class RunSpec(BaseModel):
    """What to run: one instance of a workload."""

    model_config = ConfigDict(frozen=True)

    instance: str
    workload: str
    spec: WorkloadSpec


class TaskState(StrEnum):
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    UNKNOWN = "UNKNOWN"


class TaskInfo(BaseModel):
    instance: str
    workload: str
    driver: str
    state: TaskState
    # None when the driver cannot know (e.g. a re-adopted task killed without a record).
    exit_code: int | None = None
    pid: int | None = None
    started_at: float
    finished_at: float | None = None
    message: str = ""


class DriverHealth(BaseModel):
    healthy: bool
    message: str = ""
    kinds: list[WorkloadKind] = Field(default_factory=list)


class Usage(BaseModel):
    cpu_millis: int = 0
    memory_bytes: int = 0


@dataclass(eq=False, kw_only=True)
class TrackedTask:
    """What every driver keeps of a task it runs: enough to answer `TaskInfo`.

    Drivers subclass it with their own handles (a pid file, a snapshotter, a domain).
    """

    driver: ClassVar[str] = ""

    instance: str
    workload: str
    started_at: float
    pid: int | None = None
    exit_code: int | None = None
    finished_at: float | None = None
    message: str = ""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watcher: asyncio.Task[None] | None = None

    def info(self) -> TaskInfo:
        return TaskInfo(
            instance=self.instance,
            workload=self.workload,
            driver=self.driver,
            state=TaskState.EXITED if self.done.is_set() else TaskState.RUNNING,
            exit_code=self.exit_code,
            pid=self.pid,
            started_at=self.started_at,
            finished_at=self.finished_at,
            message=self.message,
        )


class Driver(ABC):
    """A runtime driver. Every method is safe to call for tasks started by an earlier process."""

    name: ClassVar[str]

    @abstractmethod
    async def health(self) -> DriverHealth:
        """Whether the driver can start tasks now, and which workload kinds it serves."""

    @abstractmethod
    async def start(self, run: RunSpec) -> TaskInfo:
        """Start the task; raises `RuntimeFailure` with a message a user can act on."""

    @abstractmethod
    async def wait(self, instance: str) -> TaskInfo:
        """Return once the task has exited (state EXITED)."""

    @abstractmethod
    async def stop(self, instance: str, grace: float) -> TaskInfo:
        """SIGTERM, then SIGKILL after `grace` seconds; idempotent; returns the exited info."""

    @abstractmethod
    async def remove(self, instance: str) -> None:
        """Stop the task if needed and forget it with its runtime files; idempotent."""

    @abstractmethod
    async def list(self) -> list[TaskInfo]:
        """Every task this driver knows on this node, including ones a previous agent started."""

    @abstractmethod
    async def usage(self, instance: str) -> Usage:
        """Current resource usage of the task (zero once it exited)."""

    @abstractmethod
    def log_paths(self, instance: str) -> tuple[Path, Path]:
        """Paths of the task's stdout and stderr logs."""

    @abstractmethod
    async def close(self) -> None:
        """Stop watching tasks; tasks keep running so a restarted agent can re-adopt them."""


async def terminate(
    exited: Callable[[], Awaitable[object]],
    polite: Callable[[], Awaitable[None]],
    forceful: Callable[[], Awaitable[None]],
    grace: float,
    force_timeout: float,
    what: str,
) -> bool:
    """The stop every driver shares: ask politely, wait `grace`, then force and wait again.

    Returns True when forcing was needed; raises RuntimeFailure naming `what` if even that
    did not end it within `force_timeout`.
    """
    await polite()
    try:
        async with asyncio.timeout(max(grace, 0.0)):
            await exited()
        return False
    except TimeoutError:
        pass
    await forceful()
    try:
        async with asyncio.timeout(force_timeout):
            await exited()
    except TimeoutError:
        raise RuntimeFailure(f"{what} is still running after being killed") from None
    return True
