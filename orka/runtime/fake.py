"""A driver that runs nothing, for tests and benchmarks.

Knobs come from the spec so that tests drive behaviour through ordinary workloads:
- `image` or `command[0]` == "fail-start": `start` raises `RuntimeFailure`.
- env `FAKE_EXIT_AFTER=<seconds>` (and optional `FAKE_EXIT_CODE=<n>`, default 0): the task exits
  on its own after that long.
State is in memory only; a timer handle per task (no asyncio task) keeps thousands cheap.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from orka.errors import Invalid, NotFound, RuntimeFailure
from orka.models import WorkloadKind
from orka.runtime.base import (
    Driver,
    DriverHealth,
    RunSpec,
    TaskInfo,
    TaskState,
    Usage,
    check_instance,
)

FAIL_START = "fail-start"
# Exit code reported for a fake task that was stopped, matching a process killed by SIGTERM.
STOPPED_EXIT_CODE = 143


@dataclass
class _FakeTask:
    info: TaskInfo
    usage: Usage
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


class FakeDriver(Driver):
    name: ClassVar[str] = "fake"

    def __init__(self, data_dir: Path | None = None) -> None:
        self._data_dir = Path(data_dir) if data_dir is not None else Path("/nonexistent/orka-fake")
        self._tasks: dict[str, _FakeTask] = {}
        self._pid = 100_000

    async def health(self) -> DriverHealth:
        return DriverHealth(healthy=True, message="fake driver", kinds=list(WorkloadKind))

    async def start(self, run: RunSpec) -> TaskInfo:
        check_instance(run.instance)
        spec = run.spec
        if spec.image == FAIL_START or (spec.command and spec.command[0] == FAIL_START):
            raise RuntimeFailure("fake: start refused")
        exit_after, exit_code = _exit_knobs(spec.env)
        old = self._tasks.get(run.instance)
        if old is not None and old.info.state is TaskState.RUNNING:
            raise RuntimeFailure(f"fake: instance {run.instance!r} is already running")
        self._pid += 1
        task = _FakeTask(
            info=TaskInfo(
                instance=run.instance,
                workload=run.workload,
                driver=self.name,
                state=TaskState.RUNNING,
                pid=self._pid,
                started_at=time.time(),
            ),
            # Report what was requested so schedulers and benchmarks see plausible numbers.
            usage=Usage(
                cpu_millis=spec.resources.cpu_millis, memory_bytes=spec.resources.memory_bytes
            ),
        )
        self._tasks[run.instance] = task
        if exit_after is not None:
            loop = asyncio.get_running_loop()
            task.timer = loop.call_later(exit_after, self._finish, task, exit_code, "")
        return task.info.model_copy()

    async def wait(self, instance: str) -> TaskInfo:
        task = self._get(instance)
        await task.exited.wait()
        return task.info.model_copy()

    async def stop(self, instance: str, grace: float) -> TaskInfo:
        task = self._get(instance)
        self._finish(task, STOPPED_EXIT_CODE, "stopped")
        return task.info.model_copy()

    async def remove(self, instance: str, keep_network: bool = False) -> None:
        task = self._tasks.pop(instance, None)
        if task is not None:
            self._finish(task, STOPPED_EXIT_CODE, "removed")

    async def list(self) -> list[TaskInfo]:
        return [t.info.model_copy() for t in self._tasks.values()]

    async def usage(self, instance: str) -> Usage:
        task = self._get(instance)
        return task.usage if task.info.state is TaskState.RUNNING else Usage()

    keeps_logs = False

    def log_paths(self, instance: str) -> tuple[Path, Path]:
        base = self._data_dir / "instances" / check_instance(instance)
        return base / "stdout.log", base / "stderr.log"

    async def close(self) -> None:
        # Timers would fire into a loop that may be closing; the fake has nothing else to keep.
        for task in self._tasks.values():
            if task.timer is not None:
                task.timer.cancel()
                task.timer = None

    def _get(self, instance: str) -> _FakeTask:
        task = self._tasks.get(instance)
        if task is None:
            raise NotFound(f"fake: no task {instance!r}")
        return task

    def _finish(self, task: _FakeTask, exit_code: int, message: str) -> None:
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None
        if task.info.state is TaskState.EXITED:
            return
        task.info = task.info.model_copy(
            update={
                "state": TaskState.EXITED,
                "exit_code": exit_code,
                "finished_at": time.time(),
                "message": message,
            }
        )
        task.exited.set()


def _exit_knobs(env: dict[str, str]) -> tuple[float | None, int]:
    try:
        exit_after = float(env["FAKE_EXIT_AFTER"]) if "FAKE_EXIT_AFTER" in env else None
        exit_code = int(env.get("FAKE_EXIT_CODE", "0"))
    except ValueError as exc:
        raise Invalid(f"env: FAKE_EXIT_AFTER/FAKE_EXIT_CODE must be numbers ({exc})") from None
    if exit_after is not None and exit_after < 0:
        raise Invalid("env: FAKE_EXIT_AFTER must not be negative")
    return exit_after, exit_code
