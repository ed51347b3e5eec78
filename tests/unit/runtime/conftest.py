from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from orka.models import Resources, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec
from orka.runtime.cgroups import detect
from orka.runtime.process import ProcessDriver


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
    """A cgroup parent of this test's own (engineers and CI jobs share the host), removed after."""
    parent = f"orka-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield parent
    remove_cgroup_parent(parent)


def remove_cgroup_parent(parent: str) -> None:
    """Kill what a test left in its instance cgroups, then remove them and the parent."""
    cg, _ = detect(parent)
    if cg is None:
        return
    bases = {d.parent for d in cg.dirs("x")}
    for base in bases:
        for child in base.iterdir() if base.is_dir() else []:
            if child.is_dir():
                cg.remove(child.name)
    for base in bases:
        with contextlib.suppress(OSError):
            base.rmdir()


def detect_mounts() -> tuple[int, list[Path]]:
    """(cgroup version, the roots an instance cgroup is under) as `detect` would pick them."""
    cg, _ = detect("")
    if cg is None:
        return 0, []
    return cg.version, [d.parent for d in cg.dirs("x")]


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
