from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from orka.models import Resources, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec
from orka.runtime.process import ProcessDriver
from tests.cgroups import detect_mounts, remove_cgroup_parent, unique_parent

__all__ = ["detect_mounts", "remove_cgroup_parent"]


def run_spec(
    instance: str = "web-0",
    command: list[str] | None = None,
    *,
    kind: WorkloadKind = WorkloadKind.PROCESS,
    image: str = "",
    env: dict[str, str] | None = None,
    working_dir: str = "",
    resources: Resources | None = None,
    user: str = "",
    group: str = "",
) -> RunSpec:
    spec = WorkloadSpec(
        name="web",
        kind=kind,
        image=image,
        command=command if command is not None else ["sleep", "1000"],
        env=env or {},
        working_dir=working_dir,
        resources=resources or Resources(),
        user=user,
        group=group,
    )
    return RunSpec(instance=instance, workload="web", spec=spec)


def _kill_leftovers(data_dir: Path) -> None:
    """Kill every process group a test started, whatever state the drivers were left in."""
    for task_file in (data_dir / "instances").glob("*/task.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads(task_file.read_text())["pid"])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    _kill_leftovers(tmp_path)


@pytest.fixture
def cgroup_parent() -> Iterator[str]:
    """A cgroup parent of this test's own, removed after."""
    parent = unique_parent()
    yield parent
    remove_cgroup_parent(parent)


@pytest.fixture
async def make_process_driver(
    data_dir: Path, cgroup_parent: str
) -> AsyncIterator[Callable[..., ProcessDriver]]:
    """Drivers on the test's data dir. Tests that write into pytest's tmp dirs (0700 root)
    run their workloads as root (`user="root", allow_root=True`), which tests of isolation
    itself never do."""
    drivers: list[ProcessDriver] = []

    def make(**options: object) -> ProcessDriver:
        driver = ProcessDriver(data_dir, poll_interval=0.05, cgroup_parent=cgroup_parent, **options)
        drivers.append(driver)
        return driver

    yield make
    _kill_leftovers(data_dir)
    for driver in drivers:
        await driver.close()
